// Loaded with ctypes.CDLL into a Python process that has imported devshare (one_library.py):
// reports which libdevshare this component is bound to, and imports handle text through it.
#include "devshare.h"

#include <dlfcn.h>

#include <cstdint>

extern "C" {

// The address of devshare_version as this component's dynamic linking resolved it.
__attribute__((visibility("default"))) const void* same_registry_version_fn() {
    return reinterpret_cast<const void*>(&devshare_version);
}

// The file that provides devshare_version to this component (dladdr), or NULL.
__attribute__((visibility("default"))) const char* same_registry_library_file() {
    Dl_info info{};
    if (dladdr(reinterpret_cast<const void*>(&devshare_version), &info) == 0) return nullptr;
    return info.dli_fname;
}

// Import handle text through this component's libdevshare and return the first float, with the
// import left open in *out (release with same_registry_release); negative status on failure.
__attribute__((visibility("default"))) int32_t same_registry_import(const char* text, DevshareImport** out,
                                                                     float* first) {
    int32_t s = devshare_import_text(text, nullptr, out);
    if (s < 0) return s;
    DevshareImportInfo info;
    s = devshare_import_info_init(&info, sizeof info);
    if (s >= 0) s = devshare_import_info(*out, &info);
    if (s < 0) return s;
    *first = *static_cast<const float*>(info.data);
    return 0;
}

__attribute__((visibility("default"))) int32_t same_registry_release(DevshareImport* imp) {
    return devshare_import_release(imp);
}
}
