/* Built by tests/install/run.sh with the flags `pkg-config devshare` / `devshare-static` give, by
 * tests/install/cargo_only.sh against a cargo-only build, and in the build tree against
 * devshare::devshare_static: checks that the header and library agree and that a handle
 * survives a round trip. */

#include <devshare.h>

#include <stdio.h>
#include <string.h>

int main(void) {
    uint32_t version = devshare_version();
    printf("devshare_version() = 0x%06x, DEVSHARE_VERSION = 0x%06x\n", (unsigned)version,
           (unsigned)DEVSHARE_VERSION);
    /* The version rule: same major, library version at least the header's. */
    if ((version >> 16) != DEVSHARE_VERSION_MAJOR || version < DEVSHARE_VERSION) {
        fprintf(stderr, "library version does not satisfy the header's\n");
        return 1;
    }

    DevshareExporter *exporter = NULL;
    void *memory = NULL;
    DevshareHandle handle;
    DevshareImport *imp = NULL;
    DevshareImportInfo info;
    int32_t status = devshare_host_alloc(256, &exporter, &memory);
    if (status == DEVSHARE_STATUS_OK) {
        memset(memory, 0x5a, 256);
        status = devshare_exporter_share(exporter, NULL, &handle);
    }
    if (status == DEVSHARE_STATUS_OK) {
        status = devshare_import(&handle, NULL, &imp);
    }
    if (status == DEVSHARE_STATUS_OK) {
        status = devshare_import_info_init(&info, sizeof info);
    }
    if (status == DEVSHARE_STATUS_OK) {
        status = devshare_import_info(imp, &info);
    }
    int same = status == DEVSHARE_STATUS_OK && info.storage_size == 256 &&
               memcmp(info.data, memory, 256) == 0;
    if (imp != NULL && devshare_import_release(imp) != DEVSHARE_STATUS_OK) {
        same = 0;
    }
    if (exporter != NULL && devshare_exporter_close(exporter, 0) != DEVSHARE_STATUS_OK) {
        same = 0;
    }
    if (status != DEVSHARE_STATUS_OK) {
        char message[512];
        devshare_last_error(message, sizeof message);
        fprintf(stderr, "%s: %s\n", devshare_status_str(status), message);
        return 1;
    }
    if (!same) {
        fprintf(stderr, "round trip failed\n");
        return 1;
    }
    printf("round trip of 256 bytes OK\n");
    return 0;
}
