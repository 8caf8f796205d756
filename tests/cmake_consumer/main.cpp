// Round trip through an installed devshare: allocate shared host memory, hand out a handle,
// import it (as a consumer process would), check the bytes, release, close.
//
// Prints where devshare_version() was loaded from, so the install test can check that the
// installed library (shared variant) or the executable itself (static variant) provides it.

#include <devshare.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

namespace {

bool ok(int32_t status, const char* what) {
  if (status == DEVSHARE_STATUS_OK) {
    return true;
  }
  std::string message(devshare_last_error(nullptr, 0) + 1, '\0');
  devshare_last_error(message.data(), message.size());
  std::fprintf(stderr, "%s failed: %s (%d): %s\n", what, devshare_status_str(status),
               static_cast<int>(status), message.c_str());
  return false;
}

}  // namespace

int main() {
  std::printf("variant: %s\n", ROUNDTRIP_VARIANT);

  Dl_info where{};
  if (dladdr(reinterpret_cast<void*>(&devshare_version), &where) != 0 && where.dli_fname) {
    std::printf("library: %s\n", where.dli_fname);
  }

  const uint32_t version = devshare_version();
  std::printf("devshare_version() = 0x%06x, DEVSHARE_VERSION = 0x%06x\n",
              static_cast<unsigned>(version), static_cast<unsigned>(DEVSHARE_VERSION));
  // The version rule: same major, library version at least the header's.
  if ((version >> 16) != DEVSHARE_VERSION_MAJOR || version < DEVSHARE_VERSION) {
    std::fprintf(stderr, "library version does not satisfy the header's\n");
    return 1;
  }

  constexpr uint64_t size = 4096;
  DevshareExporter* exporter = nullptr;
  void* memory = nullptr;
  if (!ok(devshare_host_alloc(size, &exporter, &memory), "devshare_host_alloc")) {
    return 1;
  }
  auto* bytes = static_cast<unsigned char*>(memory);
  for (uint64_t i = 0; i < size; ++i) {
    bytes[i] = static_cast<unsigned char>(i * 7 + 3);
  }
  std::printf("exported %llu bytes of host memory\n", static_cast<unsigned long long>(size));

  DevshareHandle handle;
  if (!ok(devshare_exporter_share(exporter, nullptr, &handle), "devshare_exporter_share")) {
    devshare_exporter_close(exporter, DEVSHARE_CLOSE_FORCE);
    return 1;
  }
  char text[DEVSHARE_HANDLE_MAX_TEXT_SIZE];
  size_t text_len = 0;
  if (!ok(devshare_handle_to_text(&handle, text, sizeof text, &text_len), "devshare_handle_to_text")) {
    devshare_exporter_close(exporter, DEVSHARE_CLOSE_FORCE);
    return 1;
  }
  std::printf("handle: %.24s... (%zu characters)\n", text, text_len);

  DevshareHandle parsed;
  DevshareImport* imp = nullptr;
  if (!ok(devshare_handle_from_text(text, &parsed), "devshare_handle_from_text") ||
      !ok(devshare_import(&parsed, nullptr, &imp), "devshare_import")) {
    devshare_exporter_close(exporter, DEVSHARE_CLOSE_FORCE);
    return 1;
  }

  DevshareImportInfo info;
  int failures = 0;
  if (!ok(devshare_import_info_init(&info, sizeof info), "devshare_import_info_init") ||
      !ok(devshare_import_info(imp, &info), "devshare_import_info")) {
    ++failures;
  } else if (info.storage_size != size || info.numel != size || info.element_size != 1 ||
             info.backend != DEVSHARE_BACKEND_HOST) {
    std::fprintf(stderr, "unexpected import info: storage_size %llu, numel %llu, element_size %llu, backend %u\n",
                 static_cast<unsigned long long>(info.storage_size),
                 static_cast<unsigned long long>(info.numel),
                 static_cast<unsigned long long>(info.element_size), static_cast<unsigned>(info.backend));
    ++failures;
  } else if (std::memcmp(info.data, memory, size) != 0) {
    std::fprintf(stderr, "imported bytes differ from the exported ones\n");
    ++failures;
  } else {
    std::printf("imported %llu bytes at a separate mapping; contents match\n",
                static_cast<unsigned long long>(info.storage_size));
  }

  uint64_t outstanding = 0;
  if (!ok(devshare_import_release(imp), "devshare_import_release") ||
      !ok(devshare_exporter_outstanding(exporter, &outstanding), "devshare_exporter_outstanding")) {
    ++failures;
  } else if (outstanding != 0) {
    std::fprintf(stderr, "%llu references outstanding after release\n",
                 static_cast<unsigned long long>(outstanding));
    ++failures;
  } else {
    std::printf("released the import; no references outstanding\n");
  }

  if (!ok(devshare_exporter_close(exporter, 0), "devshare_exporter_close")) {
    ++failures;
  } else {
    std::printf("closed the exporter\n");
  }

  std::printf("%s\n", failures == 0 ? "round trip OK" : "round trip FAILED");
  return failures == 0 ? 0 : 1;
}
