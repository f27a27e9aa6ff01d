"""Experiment: does a thread-block cluster make handing a product's input to every SM cheaper?

``bench/handoff_bound.py`` measured the cheapest way of handing a W-word vector from all 132 SMs
to all 132: a kernel boundary under PDL, 1.22 µs for the decode step's 768 words and 1.69–1.71
µs for the tree verify's 12288 (16 rows of 768 float32). The difference is L2 bandwidth: every
SM reads the whole 48 KB, 6.5 MB per handoff. In a cluster of C CTAs (Hopper's thread-block
clusters) each CTA can read 1/C of the vector from L2 and write it into the shared memory of
all C (distributed shared memory), so L2 serves 1/C of the bytes.

This times chains of such kernel boundaries in CUDA graphs, PDL on as phasegraph ships them,
for C = 1 (each CTA reads the whole vector, as the shipped kernels do), 2 and 4, and for a
launch without the cluster attribute ("none"), as the slope
over 16, 64 and 256 stages; each chain's checksums are checked. The kernel is CUDA C++ (Triton
3.6 exposes neither cluster launches nor distributed shared memory), compiled by ``nvcc`` on the
GPU machine and called through ctypes on torch's current stream.

    python bench/cluster_handoff.py --out DIR [--library cluster_handoff.so]
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from handoff_bound import (  # noqa: E402
    VECTOR_WORDS,
    expected_vector_checksum,
    slope_us,
    time_chains,
    write_result,
)

PROGRAMS = 132
CLUSTERS = (0, 1, 2, 4)  # 0: no cluster attribute at all
GATHERS = ("shared, cluster sync", "registers", "shared, block sync")  # the kernel's Gather
# (cluster, PDL, gather) of each measured row: the clusters, PDL off, and the two other gathers
VARIANTS = ([(c, True, GATHERS[0]) for c in CLUSTERS] + [(0, False, GATHERS[0])]
            + [(0, True, gather) for gather in GATHERS[1:]])
THREADS = 256

CUDA_SOURCE = r"""
#include <cooperative_groups.h>
#include <cuda_runtime.h>
namespace cg = cooperative_groups;

constexpr int THREADS = 256;
constexpr int MAX_LOADS = 16;  // 16-byte loads in flight per thread: vectors of up to 16384 words

// How a CTA takes in the vector: into shared memory, then a cluster barrier (each CTA of a
// cluster reads its 1/C and stores it into all C CTAs' shared memory); summed straight from the
// registers it was loaded into (a cluster of one only); into shared memory, then a block barrier
// (a cluster of one only).
enum Gather { SHARED_CLUSTER_SYNC = 0, REGISTERS = 1, SHARED_BLOCK_SYNC = 2 };

// One step of a chain of handoffs: wait for the kernel before (PDL), take in the W-word vector it
// wrote (all of a CTA's 16-byte loads in flight at once) as ``gather`` says, add it into this
// CTA's checksum, then write this stage's words.
__global__ void __launch_bounds__(THREADS) handoff_step(
    const unsigned* __restrict__ src, unsigned* __restrict__ dst, unsigned* __restrict__ checksum,
    unsigned stage, int words, int per_program, int gather) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
  extern __shared__ uint4 vec[];
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned size = cluster.num_blocks();
  const unsigned rank = cluster.block_rank();
  const int slice = words / size / 4;  // 16-byte pieces
  const uint4* from = reinterpret_cast<const uint4*>(src) + rank * slice;
  uint4 piece[MAX_LOADS];
#pragma unroll
  for (int k = 0; k < MAX_LOADS; ++k) {
    const int i = threadIdx.x + k * THREADS;
    if (i < slice) piece[k] = __ldcg(from + i);
  }
  unsigned s = 0;
  if (gather == REGISTERS) {
#pragma unroll
    for (int k = 0; k < MAX_LOADS; ++k)
      if (threadIdx.x + k * THREADS < slice) s += piece[k].x + piece[k].y + piece[k].z + piece[k].w;
  } else {
#pragma unroll
    for (int k = 0; k < MAX_LOADS; ++k) {
      const int i = threadIdx.x + k * THREADS;
      if (i < slice) {
        if (size == 1) {
          vec[i] = piece[k];
        } else {
          for (unsigned r = 0; r < size; ++r) cluster.map_shared_rank(vec, r)[rank * slice + i] = piece[k];
        }
      }
    }
    if (gather == SHARED_BLOCK_SYNC) {
      __syncthreads();
    } else {
      cluster.sync();  // every CTA's slice is in every CTA's shared memory
    }
    for (int i = threadIdx.x; i < words / 4; i += THREADS) {
      const uint4 v = vec[i];
      s += v.x + v.y + v.z + v.w;
    }
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  __shared__ unsigned part[THREADS / 32];
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned total = 0;
    for (int w = 0; w < THREADS / 32; ++w) total += part[w];
    checksum[blockIdx.x] += total;
  }
  for (int j = threadIdx.x; j < per_program; j += THREADS) {
    const int index = blockIdx.x * per_program + j;
    if (index < words) dst[index] = stage * words + index;
  }
}

// cluster 0: a launch without the cluster attribute (each CTA its own cluster of one)
static cudaLaunchConfig_t config_for(int programs, int words, int cluster, bool pdl, void* stream,
                                     cudaLaunchAttribute* attrs) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(programs);
  config.blockDim = dim3(THREADS);
  config.dynamicSmemBytes = words * sizeof(unsigned);
  config.stream = static_cast<cudaStream_t>(stream);
  config.attrs = attrs;
  if (cluster > 0) {
    attrs[config.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attrs[config.numAttrs].val.clusterDim.x = cluster;
    attrs[config.numAttrs].val.clusterDim.y = 1;
    attrs[config.numAttrs].val.clusterDim.z = 1;
    ++config.numAttrs;
  }
  if (pdl) {
    attrs[config.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[config.numAttrs].val.programmaticStreamSerializationAllowed = 1;
    ++config.numAttrs;
  }
  return config;
}

extern "C" int handoff_step_launch(const void* src, void* dst, void* checksum, unsigned stage,
                                   int words, int programs, int cluster, int pdl, int gather,
                                   void* stream) {
  const int c = cluster > 0 ? cluster : 1;
  if (words % (4 * c) || programs % c || words > 4 * MAX_LOADS * THREADS ||
      (gather != SHARED_CLUSTER_SYNC && c != 1))
    return cudaErrorInvalidValue;
  cudaError_t err = cudaFuncSetAttribute(handoff_step, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         words * sizeof(unsigned));
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attrs[2];
  cudaLaunchConfig_t config = config_for(programs, words, cluster, pdl != 0, stream, attrs);
  const int per_program = (words + programs - 1) / programs;
  return cudaLaunchKernelEx(&config, handoff_step, static_cast<const unsigned*>(src),
                            static_cast<unsigned*>(dst), static_cast<unsigned*>(checksum), stage,
                            words, per_program, gather);
}

extern "C" int handoff_max_active_clusters(int programs, int words, int cluster, int* count) {
  cudaError_t err = cudaFuncSetAttribute(handoff_step, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         words * sizeof(unsigned));
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attrs[2];
  cudaLaunchConfig_t config = config_for(programs, words, cluster, false, nullptr, attrs);
  if (cluster == 0) {
    *count = 0;
    return cudaSuccess;
  }
  return cudaOccupancyMaxActiveClusters(count, handoff_step, &config);
}

extern "C" const char* handoff_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
"""


class ClusterHandoff:
    """The CUDA kernel, compiled by nvcc for sm_90 into a shared library and called by ctypes
    on the current torch stream (so that CUDA graphs capture it)."""

    def __init__(self, library: Path):
        self.lib = ctypes.CDLL(str(library))
        self.lib.handoff_error_string.restype = ctypes.c_char_p

    @staticmethod
    def build(build_dir: Path) -> Path:
        """Compile CUDA_SOURCE with nvcc (for sm_90, the CUDA runtime linked statically)."""
        build_dir.mkdir(parents=True, exist_ok=True)
        source, library = build_dir / "cluster_handoff.cu", build_dir / "cluster_handoff.so"
        source.write_text(CUDA_SOURCE)
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        subprocess.run([nvcc, "-arch=sm_90", "-O3", "-shared", "-Xcompiler", "-fPIC", "-o",
                        str(library), str(source)], check=True)
        return library

    def _check(self, err: int) -> None:
        if err:
            raise RuntimeError(self.lib.handoff_error_string(err).decode())

    def step(self, src: torch.Tensor, dst: torch.Tensor, checksum: torch.Tensor, stage: int,
             words: int, cluster: int, pdl: bool = True, gather: str = "shared, cluster sync",
             ) -> None:
        self._check(self.lib.handoff_step_launch(
            ctypes.c_void_p(src.data_ptr()), ctypes.c_void_p(dst.data_ptr()),
            ctypes.c_void_p(checksum.data_ptr()), ctypes.c_uint(stage), words, checksum.numel(),
            cluster, int(pdl), GATHERS.index(gather),
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)))

    def max_active_clusters(self, programs: int, words: int, cluster: int) -> int:
        count = ctypes.c_int(0)
        self._check(self.lib.handoff_max_active_clusters(programs, words, cluster,
                                                         ctypes.byref(count)))
        return count.value


def measure(ext, words: int, cluster: int, pdl: bool = True,
            gather: str = "shared, cluster sync") -> dict:
    """µs per handoff of a ``words``-word vector among PROGRAMS CTAs in clusters of ``cluster``."""
    buffers = torch.zeros(2 * words, dtype=torch.int32, device="cuda")
    checksum = torch.zeros(PROGRAMS, dtype=torch.int32, device="cuda")

    def work(stages):
        checksum.zero_()
        buffers.zero_()
        for stage in range(stages):
            ext.step(buffers[(stage + 1) % 2 * words:], buffers[stage % 2 * words:], checksum,
                     stage, words, cluster, pdl, gather)

    def check(stages):
        want = expected_vector_checksum(stages - 1, words)  # stage s reads what s - 1 wrote
        if not bool((checksum.cpu() == want).all()):
            raise AssertionError(f"cluster {cluster}, {words} words, {stages} stages: a CTA summed "
                                 f"{checksum.cpu().tolist()[:4]}..., not {want}")

    times = time_chains(work, check)
    return {"words": words, "cluster": cluster, "pdl": pdl, "gather": gather,
            "max_active_clusters": ext.max_active_clusters(PROGRAMS, words, cluster),
            "us_by_stages": times, "us_per_handoff": slope_us(times)}


def report(result: dict) -> str:
    lines = [f"Device: {result['device']}; torch {result['torch']}", "",
             f"Kernel boundaries, {PROGRAMS} CTAs, each taking in the whole vector: into shared "
             "memory then a cluster barrier (a cluster's CTAs each read 1/C of it from L2 and "
             "store it into all C), or, in clusters of one, summed from registers or into shared "
             "memory then a block barrier.", "",
             "| words (32-bit) | cluster | PDL | gather | clusters resident at once "
             "| µs by stage count | µs per handoff |", "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        stages = ", ".join(f"{s}: {t:.1f}" for s, t in row["us_by_stages"].items())
        lines.append(f"| {row['words']} | {row['cluster'] or 'none'} | {'on' if row['pdl'] else 'off'} "
                     f"| {row['gather']} | {row['max_active_clusters']} "
                     f"| {stages} | {row['us_per_handoff']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--library", type=Path,
                        help="a cluster_handoff.so built before (else nvcc builds one here)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cluster_handoff.py: needs a CUDA GPU of compute capability 9.0", file=sys.stderr)
        return 2
    library = args.library or ClusterHandoff.build(Path(tempfile.mkdtemp(prefix="cluster_handoff_")))
    ext = ClusterHandoff(library)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "rows": [measure(ext, words, cluster, pdl, gather) for words in VECTOR_WORDS
                       for cluster, pdl, gather in VARIANTS]}
    write_result(args.out, "cluster_handoff", result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
