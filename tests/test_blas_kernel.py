"""Which BLAS kernels ran, and a pin below the CPU (mpicube/device/blas_kernel.py)."""

from mpicube.device import blas_kernel

AVX512 = {"sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw"}
AVX2 = {"sse4_2", "avx", "avx2", "fma"}


def test_a_pin_below_the_cpu_is_one_line_and_only_then():
    line = blas_kernel.pin_warning({"OPENBLAS_CORETYPE": "Haswell"}, AVX512)
    assert line == ("warning: OPENBLAS_CORETYPE=Haswell holds OpenBLAS to Haswell's kernels on a CPU that runs "
                    "SkylakeX's: GEMMs, and the times below, are slower than this machine's (unset it for a "
                    "benchmark)")
    assert blas_kernel.pin_warning({"OPENBLAS_CORETYPE": "haswell"}, AVX2) is None          # what the CPU runs
    assert blas_kernel.pin_warning({"OPENBLAS_CORETYPE": "SkylakeX"}, AVX512) is None
    assert blas_kernel.pin_warning({}, AVX512) is None
    assert blas_kernel.pin_warning({"OPENBLAS_CORETYPE": "Zen"}, set()) is None               # CPU unknown
    assert "Sandybridge's kernels on a CPU that runs Haswell's" in \
        blas_kernel.pin_warning({"OPENBLAS_CORETYPE": "Sandybridge"}, AVX2)


def test_cpu_flags_come_from_the_first_processor():
    info = "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert blas_kernel.cpu_flags(info) == {"fpu", "sse4_2", "avx", "avx2"}
    assert blas_kernel.cpu_kernels(blas_kernel.cpu_flags(info)) == (4, "Haswell")


def test_describe_names_the_kernels_threadpoolctl_reports():
    pools = [{"user_api": "blas", "internal_api": "openblas", "version": "0.3.31", "num_threads": 2,
              "architecture": "SkylakeX"}]
    assert blas_kernel.describe(pools) == "openblas 0.3.31 (SkylakeX kernels, 2 thread(s))"
    assert blas_kernel.describe([]).startswith("unknown")
    here = blas_kernel.describe()
    assert here == blas_kernel.describe(blas_kernel.blas_pools()) and "thread(s)" in here
