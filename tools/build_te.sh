#!/usr/bin/env bash
# Build TransformerEngine (PyTorch, sm_90 only) on a Hopper GPU machine from the kit of
# ../shared/tools/te/fetch.sh (carried as .te), slimmed so it fits one session's device time.
#   bash tools/build_te.sh KIT [JOBS] [SECONDS] [OUTDIR]   -> TE installed under /tmp/tesite (PYTHONPATH) on success;
#   with OUTDIR (e.g. $OUT) also /tmp/tesite as OUTDIR/tesite.tgz.part* (15 MB each, about 47 MB in all), to
#   repack and carry on later calls (docs/transformer_engine.md: .te/built/tesite.tar.xz, 29 MB)
# Slim: the six grouped-activation translation units (activation/*_grouped*.cu: nvte_group_{gelu,relu,silu,...},
# kernels for NVTEGroupedTensor inputs, which TE's PyTorch extension never calls; they serve Blackwell's fused
# grouped MLP) are compiled as stubs that raise NVTE_ERROR naming the function. Every other source, the Hopper
# GEMM, cast, attention, normalization and optimizer paths, is built as TE ships it. NCCL EP is off.
# The build is resumable while the machine is held (NVTE_CMAKE_BUILD_DIR persists under /tmp/teb).
# JOBS defaults to the machine's cores; the ninja log (each step's start and end) is left in /tmp/te_ninja_log.
# docs/transformer_engine.md gives the measured times.
set -uo pipefail
kit=$(cd "$1" && pwd); jobs=${2:-$(nproc)}; budget=${3:-540}; outdir=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/teb && cd /tmp/teb
if [ ! -d te ]; then
  tar xzf "$kit/te-src.tar.gz" && tar xzf "$kit/cutlass-inc.tar.gz"
  python3 "$here/te_slim.py" te/transformer_engine/common/activation || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tesite "$kit"/*.whl
export PYTHONPATH=/tmp/tesite:${PYTHONPATH:-}
site=$(python3 -c 'import site;print(site.getsitepackages()[0])')
export CUDNN_PATH=$(dirname $(dirname $(find $site/nvidia -name cudnn.h | head -1)))
export NCCL_HOME=$(dirname $(dirname $(find $site/nvidia -name nccl.h | head -1)))
export NVTE_CMAKE_EXTRA_ARGS="-DNCCL_INCLUDE_DIR=$NCCL_HOME/include"
export NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 NVTE_WITH_NCCL_EP=0 MAX_JOBS=$jobs NVTE_BUILD_THREADS_PER_JOB=1
export CUDA_HOME=/usr/local/cuda NVTE_CMAKE_BUILD_DIR=/tmp/teb/cmake
cd te
start=$(date +%s)
timeout "$budget" python3 -m pip install -v --no-build-isolation --no-deps --no-index --no-compile \
  --target /tmp/tesite . > /tmp/te_build.log 2>&1
rc=$?; echo "TE build rc=$rc after $(( $(date +%s) - start )) s with $jobs jobs"
cp /tmp/teb/cmake/.ninja_log /tmp/te_ninja_log 2>/dev/null
grep -E "^\[[0-9]+/[0-9]+\]" /tmp/te_build.log | tail -2
[ $rc -eq 0 ] || grep -iE "error|fatal" /tmp/te_build.log | grep -v "Werror\|-Wno" | head -15
du -sh /tmp/tesite/transformer_engine 2>/dev/null
[ $rc -eq 0 ] && [ -n "$outdir" ] && tar czf - -C /tmp tesite | split -b 15M - "$outdir/tesite.tgz.part"
exit $rc
