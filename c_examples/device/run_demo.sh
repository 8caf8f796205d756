#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# run_demo.sh <log> <producer> <consumer>: run a device example pair over a test stand-in runtime
# and fail if the stand-in recorded any rule violation, in either process.
#
# The stand-ins (tests/standin) append one line per broken runtime rule to $DEVSHARE_STANDIN_LOG;
# an empty log means both programs used the runtime as its documentation requires. The caller
# sets DEVSHARE_ACL_LIBRARY / DEVSHARE_CUDA_LIBRARY (CTest does). Exit status: the producer's,
# or 1 when the log is not empty; 2 on a usage error.
#
#   DEVSHARE_ACL_LIBRARY=.../standin/acl/libascendcl.so \
#       bash c_examples/device/run_demo.sh /tmp/npu.log ./npu_producer ./npu_consumer
set -u

if [[ $# -ne 3 ]]; then
    echo "usage: $0 <log> <producer> <consumer>" >&2
    exit 2
fi
log=$1 producer=$2 consumer=$3

rm -f -- "$log"
export DEVSHARE_STANDIN_LOG=$log
"$producer" "$consumer"
rc=$?
if [[ -s $log ]]; then
    echo "run_demo: the stand-in recorded rule violations ($log):" >&2
    sed 's/^/  /' -- "$log" >&2
    exit 1
fi
exit "$rc"
