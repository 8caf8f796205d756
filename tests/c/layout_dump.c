/* SPDX-License-Identifier: Apache-2.0 */
/*
 * layout_dump: what the C compiler makes of include/devshare.h, for the ctypes mirror test
 * (tests/python/test_abi_layout.py compiles and runs it at test time; nothing links it to the
 * library). It prints abi_layout_print()'s lines for the lists of abi_fields.h: every struct's
 * sizeof and alignment, every field's offset and size, every macro's and status code's value.
 * The lists themselves live in abi_fields.h, shared with `gpu_tool layout` (tests/gpu).
 */

#include "abi_fields.h"

int main(void) {
    abi_layout_print(stdout);
    return 0;
}
