"""OOM recognition, table-driven, with real exceptions (and exact look-alikes of other frameworks)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from colab_resilience import memory, oom


def lookalike(qualname: str, base: type, message: str) -> BaseException:
    """An exception of a class with exactly the module and name a framework uses."""
    module, _, name = qualname.rpartition(".")
    cls = type(name, (base,), {"__module__": module})
    return cls(message)


def real_torch_cpu_oom() -> BaseException:
    try:
        torch.empty(1 << 60, dtype=torch.uint8)
    except RuntimeError as e:
        return e
    raise AssertionError("an exabyte was allocated")


def real_memory_error() -> BaseException:
    try:
        bytearray(1 << 62)
    except MemoryError as e:
        return e
    raise AssertionError("unreachable")


def real_numpy_oom() -> BaseException:
    try:
        np.empty(1 << 62, dtype=np.uint8)
    except MemoryError as e:
        return e
    raise AssertionError("unreachable")


def chained(outer: BaseException, inner: BaseException, cause: bool = True) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as e:
            if cause:
                raise outer from e
            raise outer
    except BaseException as e:
        return e


CUDA_OOM_MSG = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 14.75 GiB"

POSITIVE = [
    ("torch CPU allocator (real)", real_torch_cpu_oom, "DefaultCPUAllocator: can't allocate memory"),
    ("torch.OutOfMemoryError", lambda: torch.OutOfMemoryError(CUDA_OOM_MSG), "CUDA out of memory"),
    ("torch.cuda.OutOfMemoryError", lambda: torch.cuda.OutOfMemoryError(CUDA_OOM_MSG), "CUDA out of memory"),
    ("MemoryError (real)", real_memory_error, "MemoryError"),
    ("NumPy _ArrayMemoryError (real)", real_numpy_oom, "MemoryError: Unable to allocate 4.00 EiB for an array with shape (4611686"),
    ("TorchScript re-raise", lambda: RuntimeError(
        "The following operation failed in the TorchScript interpreter.\nTraceback of TorchScript "
        "code:\nRuntimeError: " + CUDA_OOM_MSG), "CUDA out of memory"),
    ("CUDA error: out of memory", lambda: RuntimeError(
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"), "CUDA error: out of memory"),
    ("generic ' out of memory.'", lambda: RuntimeError("HIP out of memory. Tried to allocate"), "out of memory"),
    ("MPS", lambda: RuntimeError(
        "MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.2 GB)"), "MPS backend out of memory"),
    ("cuBLAS", lambda: RuntimeError(
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), "CUBLAS_STATUS_ALLOC_FAILED"),
    ("TensorFlow", lambda: lookalike(
        "tensorflow.python.framework.errors_impl.ResourceExhaustedError", Exception,
        "OOM when allocating tensor with shape[8192,65536] and type float"), "TensorFlow resources exhausted"),
    ("JAX JaxRuntimeError", lambda: lookalike(
        "jaxlib._jax.JaxRuntimeError", RuntimeError,
        "RESOURCE_EXHAUSTED: Out of memory allocating 17179869184 bytes."), "RESOURCE_EXHAUSTED"),
    ("JAX XlaRuntimeError (older jaxlib)", lambda: lookalike(
        "jaxlib.xla_extension.XlaRuntimeError", RuntimeError,
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1024 bytes."), "RESOURCE_EXHAUSTED"),
    ("OOM as __cause__", lambda: chained(ValueError("loader failed"), torch.OutOfMemoryError(CUDA_OOM_MSG)),
     "CUDA out of memory"),
    ("an OOM wrapped by a re-raise that repeats it", lambda: chained(
        RuntimeError("forward failed: " + CUDA_OOM_MSG), torch.OutOfMemoryError(CUDA_OOM_MSG), cause=False),
     "CUDA out of memory"),
    ("HIP", lambda: RuntimeError("HIP error: out of memory\nHIP kernel errors might be asynchronously reported"),
     "HIP error: out of memory"),
    ("CUDA driver", lambda: RuntimeError("CUDA driver error: out of memory"), "CUDA driver error: out of memory"),
    ("cuDNN alloc", lambda: RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), "CUDNN_STATUS_ALLOC_FAILED"),
    ("cuDNN workspace", lambda: RuntimeError(
        "cuDNN Frontend error: [cudnn_frontend] Error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE"), "cuDNN: not enough workspace"),
    ("cuSOLVER", lambda: RuntimeError("cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`"),
     "CUSOLVER_STATUS_ALLOC_FAILED"),
    ("cuFFT", lambda: RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED"), "CUFFT_ALLOC_FAILED"),
    ("NCCL", lambda: lookalike("torch.distributed.DistBackendError", RuntimeError,
                               "NCCL error in: ProcessGroupNCCL.cpp:1691, unhandled cuda error (run with NCCL_DEBUG=INFO "
                               "for details), NCCL version 2.21.5\nLast error:\nCuda failure 'out of memory'"),
     "NCCL: CUDA out of memory"),
    ("a DataLoader worker killed by the OOM killer", lambda: RuntimeError(
        "DataLoader worker (pid 4242) is killed by signal: Killed. "), "a DataLoader worker was killed (out of host memory)"),
    ("a DataLoader worker out of shared memory", lambda: RuntimeError(
        "DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible that dataloader's workers are out "
        "of shared memory. Please try to raise your shared memory limit."), "a DataLoader worker ran out of shared memory"),
    ("a full /dev/shm", lambda: RuntimeError(
        "unable to write to file </torch_123_3386862183_0>: No space left on device (28)"), "shared memory (/dev/shm) is full"),
]

RESTART = [
    ("device-side assert", lambda: RuntimeError(
        "CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA` to enable"),
     "CUDA device-side assert triggered"),
    ("illegal memory access", lambda: RuntimeError(
        "CUDA error: an illegal memory access was encountered"), "CUDA illegal memory access"),
    ("poisoned context wins over OOM in the chain", lambda: chained(
        torch.OutOfMemoryError(CUDA_OOM_MSG), RuntimeError("CUDA error: device-side assert triggered")),
     "CUDA device-side assert triggered"),
]

NEGATIVE = [
    ("shape mismatch", lambda: RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)")),
    ("ValueError mentioning memory", lambda: ValueError("not enough memory for this config: out of memory.")),
    ("TypeError mentioning OOM", lambda: TypeError("CUDA out of memory")),
    ("KeyboardInterrupt", lambda: KeyboardInterrupt()),
    ("SystemExit", lambda: SystemExit(1)),
    ("OSError ENOMEM is not an allocator OOM", lambda: OSError(12, "Cannot allocate memory")),
    ("a class named like TF's in another module", lambda: lookalike(
        "mylib.errors.ResourceExhaustedError", Exception, "quota exceeded")),
    ("None", lambda: None),
    ("an ordinary error raised while handling an OOM", lambda: chained(
        ValueError("batch size must be a power of two"), torch.OutOfMemoryError(CUDA_OOM_MSG), cause=False)),
    ("an ordinary error raised while handling a real CPU OOM", lambda: chained(
        KeyError("batch"), real_torch_cpu_oom(), cause=False)),
    ("user text quoting the words", lambda: RuntimeError("the notes say: CUDA out of memory. happened last week")),
    ("an API quota", lambda: RuntimeError("429 RESOURCE_EXHAUSTED: Quota exceeded for aiplatform.googleapis.com")),
    ("an API quota as JAX-like text", lambda: lookalike(
        "jaxlib._jax.JaxRuntimeError", RuntimeError, "RESOURCE_EXHAUSTED: 429 Too many requests")),
]


@pytest.mark.parametrize("name,make,label", POSITIVE, ids=[p[0] for p in POSITIVE])
def test_recognised_as_recoverable_oom(name, make, label):
    verdict = oom.classify(make())
    assert verdict is not None, name
    assert verdict.kind == oom.RECOVERABLE
    assert verdict.label == label
    assert not verdict.needs_restart


@pytest.mark.parametrize("name,make,label", RESTART, ids=[p[0] for p in RESTART])
def test_poisoned_cuda_needs_restart(name, make, label):
    verdict = oom.classify(make())
    assert verdict is not None and verdict.needs_restart
    assert verdict.label == label


@pytest.mark.parametrize("name,make", NEGATIVE, ids=[p[0] for p in NEGATIVE])
def test_not_an_oom(name, make):
    assert oom.classify(make()) is None
    assert not oom.is_oom(make())


def test_cyclic_chain_terminates():
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert oom.classify(a) is None


def test_classifying_imports_no_framework():
    code = textwrap.dedent(
        """
        import sys
        from colab_resilience import oom
        def lookalike(q, base, msg):
            m, _, n = q.rpartition('.')
            return type(n, (base,), {'__module__': m})(msg)
        assert oom.classify(lookalike('tensorflow.python.framework.errors_impl.ResourceExhaustedError',
                                      Exception, 'OOM when allocating')) is not None
        assert oom.classify(lookalike('jaxlib._jax.JaxRuntimeError', RuntimeError,
                                      'RESOURCE_EXHAUSTED: Out of memory')) is not None
        assert oom.classify(RuntimeError('CUDA out of memory. Tried')) is not None
        oom.release(RuntimeError('x'))
        loaded = [m for m in ('torch', 'tensorflow', 'jax', 'numpy') if m in sys.modules]
        print(loaded)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_release_frees_what_the_traceback_holds():
    """A real 512 MiB array held by a failing frame comes back to the OS after release()."""

    def failing_step():
        held = np.ones(512 << 20, dtype=np.uint8)  # touched pages: really resident
        raise torch.OutOfMemoryError(CUDA_OOM_MSG + f" ({held.size})")

    failure = None
    try:
        failing_step()
    except RuntimeError as e:
        failure = e
    assert memory.rss_bytes() > 400 << 20
    freed = oom.release(failure)
    assert freed >= 400 << 20, memory.format_bytes(freed)
    assert failure.__traceback__ is None


def test_format_bytes():
    assert memory.format_bytes(512) == "512 B"
    assert memory.format_bytes(1.1 * (1 << 30)) == "1.1 GiB"
    assert memory.format_bytes(3 << 20) == "3.0 MiB"
    # just under 1 GiB (what a CUDA OOM freed, measured on an H200): not "1024.0 MiB"
    assert memory.format_bytes((1 << 30) - 512) == "1.0 GiB"
    assert memory.format_bytes(1023) == "1023 B" and memory.format_bytes(1023.96 * 1024) == "1.0 MiB"
