"""Random-number states, saved with every checkpoint and restored with it.

Python's ``random``, NumPy's global generator (if NumPy is imported), torch's CPU generator and
that of every initialised CUDA device (if torch is imported), and TensorFlow's global seed state
(if TensorFlow is imported and ``tf.random.set_seed`` was called), and the state of Keras's global
``SeedGenerator`` (if Keras 3 is imported: ``keras.random`` calls without a seed; or that it was
not made yet, which a restore in a kernel that has made it since cannot undo:
:class:`~colab_resilience.errors.BuiltSinceError`): a training resumed from a checkpoint draws
the same numbers it would have drawn without the interruption.

TensorFlow gives an eager random op without a seed of its own an operation seed drawn from a
Python ``random.Random`` its eager context holds (seeded by ``tf.random.set_seed``); that
generator's state is what is saved. TensorFlow has no public call to read or set it, so this uses
the context's ``_seed`` and ``_rng`` attributes (and ``_set_global_seed``, what
``tf.random.set_seed`` calls), and saves nothing where they are not there. A random op given a
seed of its own keeps its numbers in TensorFlow's kernel, where no checkpoint reaches them.

With them go torch's and TensorFlow's process-wide settings that change what a computation gives
(:func:`torch_settings`, :func:`tf_settings`): a cell that is not ``%%replay`` may have set them,
and a new kernel would have the libraries' defaults.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any, Mapping

from ..errors import CheckpointWarning


def is_generator(value: Any) -> bool:
    """Whether ``value`` is a random number generator of its own: torch's ``Generator``, NumPy's
    ``Generator`` or ``RandomState``, Python's ``random.Random``."""
    import random

    torch, npr = sys.modules.get("torch"), sys.modules.get("numpy.random")
    return (isinstance(value, random.Random) or (torch is not None and isinstance(value, torch.Generator))
            or (npr is not None and isinstance(value, (npr.Generator, npr.RandomState))))


def generator_state(g: Any) -> Any:
    """The state of a generator :func:`is_generator` accepts, as plain data and tensors (a copy)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(g, torch.Generator):
        return g.get_state()
    if hasattr(g, "bit_generator"):  # NumPy's Generator
        return {"bit_generator": dict(g.bit_generator.state)}
    if hasattr(g, "get_state"):  # NumPy's RandomState
        return {"legacy": g.get_state(legacy=True)}
    return g.getstate()  # random.Random


def set_generator_state(g: Any, state: Any) -> None:
    """Put a :func:`generator_state` into ``g`` (a generator of the kind it was taken from)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(g, torch.Generator):
        g.set_state(state)
    elif hasattr(g, "bit_generator"):
        g.bit_generator.state = state["bit_generator"]
    elif hasattr(g, "get_state"):
        g.set_state(tuple(state["legacy"]))
    else:
        g.setstate(_tuples(state))


def _tuples(value: Any) -> Any:
    """``random.Random`` state as ``setstate`` wants it: tuples all the way (a checkpoint may hand
    back lists)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def capture_rng() -> dict[str, Any]:
    """The random-number states: Python, NumPy (if imported), torch CPU and initialised CUDA,
    TensorFlow's and Keras's; and the process-wide settings of torch, TensorFlow and JAX that change
    what a computation gives."""
    import random

    state: dict[str, Any] = {"python": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state(legacy=True)
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
    tf = _tf_context()
    if tf is not None and getattr(tf, "_rng", None) is not None:
        state["tensorflow"] = {"seed": int(tf._seed), "rng": tf._rng.getstate()}
    if _keras_3():
        # None: not made yet (a restore finds it made only where a retry in this kernel follows an
        # attempt that made it: BuiltSinceError, see restore_rng)
        seeds = keras_seed_generator()
        state["keras"] = None if seeds is None else np.array(seeds.state.numpy(), copy=True)
    if torch is not None:
        state["torch_settings"] = torch_settings(torch)
    tf_config = sys.modules.get("tensorflow.python.framework.config")
    if tf_config is not None:
        state["tf_settings"] = tf_settings(tf_config)
    jax_config = _jax_config()
    if jax_config is not None:
        state["jax_settings"] = jax_settings(jax_config)
    return state


# the kernels of torch's scaled_dot_product_attention, each switched by torch.backends.cuda.enable_<name>_sdp
_SDP = ("flash", "mem_efficient", "math", "cudnn")


def torch_settings(torch) -> dict[str, Any]:
    """torch's process-wide settings that change what a computation gives: the default dtype (of
    ``torch.randn(n)``), the CPU threads (the order of a sum's partial sums), deterministic
    algorithms, the float32 matmul precision (TF32 on a GPU: what ``allow_tf32`` sets too), cuDNN's
    benchmark and deterministic modes and its TF32 convolutions, the reduced-precision reductions
    of float16 and bfloat16 matmuls, and which kernels ``scaled_dot_product_attention`` may
    choose (flash, memory-efficient, math, cuDNN: the attention of a transformer; flash's off
    gives other numbers on the CPU too). A cell that is not ``%%replay`` may set them
    (``torch.set_float32_matmul_precision("high")``, as Lightning advises; ``torch.set_default_dtype``),
    and a new kernel has torch's defaults: the resumed run would compute otherwise, saying nothing.
    A setting that cannot be read is left out (the matmul precision, where a notebook set it through
    both of torch's APIs: reading it raises then)."""
    found: dict[str, Any] = {}
    for key, read in (
            ("default_dtype", lambda: str(torch.get_default_dtype()).removeprefix("torch.")),
            ("threads", torch.get_num_threads),
            ("deterministic", lambda: [torch.are_deterministic_algorithms_enabled(),
                                       torch.is_deterministic_algorithms_warn_only_enabled()]),
            ("matmul_precision", torch.get_float32_matmul_precision),
            ("cudnn", lambda: [bool(torch.backends.cudnn.benchmark), bool(torch.backends.cudnn.deterministic)]),
            ("cudnn_tf32", lambda: bool(torch.backends.cudnn.allow_tf32)),
            ("reduced_precision", lambda: [bool(torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
                                           bool(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)]),
            ("sdp", lambda: {name: bool(getattr(torch.backends.cuda, f"{name}_sdp_enabled")())
                             for name in _SDP if hasattr(torch.backends.cuda, f"{name}_sdp_enabled")})):
        with contextlib.suppress(Exception):
            found[key] = read()
    return found


def _set_torch_settings(torch, saved: Any) -> None:
    """Put back each setting :func:`torch_settings` returned that differs now (one that cannot be
    read now, or is malformed, is left as it is: setting it would mix torch's two APIs for it)."""
    if not isinstance(saved, Mapping):
        return
    now = torch_settings(torch)
    differs = [k for k, v in saved.items() if k in now and now[k] != v]
    for key in differs:
        with contextlib.suppress(Exception):
            value = saved[key]
            if key == "default_dtype":
                dtype = getattr(torch, str(value), None)
                if isinstance(dtype, torch.dtype):
                    torch.set_default_dtype(dtype)
            elif key == "threads":
                torch.set_num_threads(int(value))
            elif key == "deterministic":
                torch.use_deterministic_algorithms(bool(value[0]), warn_only=bool(value[1]))
            elif key == "matmul_precision":
                torch.set_float32_matmul_precision(str(value))
            elif key == "cudnn":
                torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = bool(value[0]), bool(value[1])
            elif key == "cudnn_tf32":
                torch.backends.cudnn.allow_tf32 = bool(value)
            elif key == "reduced_precision":
                matmul = torch.backends.cuda.matmul
                matmul.allow_fp16_reduced_precision_reduction = bool(value[0])
                matmul.allow_bf16_reduced_precision_reduction = bool(value[1])
            elif key == "sdp":
                for name, on in value.items():
                    if name in _SDP:
                        getattr(torch.backends.cuda, f"enable_{name}_sdp")(bool(on))


# TensorFlow's settings that change what a computation gives, as (reader, writer) names in its
# framework config module: op determinism (what Keras's advice for reproducible training pairs with
# keras.utils.set_random_seed), TensorFloat-32 matmuls and convolutions on a GPU (on by default)
_TF_SETTINGS = {"op_determinism": ("is_op_determinism_enabled", None),
                "tensor_float_32": ("tensor_float_32_execution_enabled", "enable_tensor_float_32_execution")}
# the threads of one op (how a reduction splits its sum: tf.config.threading's intra-op pool; 0 is
# TensorFlow's default, one per core), which TensorFlow takes once, as it runs its first op
_TF_THREADS = ("get_intra_op_parallelism_threads", "set_intra_op_parallelism_threads")


def tf_settings(config) -> dict[str, Any]:
    """TensorFlow's process-wide settings of :data:`_TF_SETTINGS` and the size of its intra-op thread
    pool (:func:`tf_threads_lost`), read through its framework config module ``config``. A cell
    that is not ``%%replay`` may set them (``tf.config.experimental.enable_op_determinism()``),
    and a new kernel has TensorFlow's defaults: on a GPU the resumed run would compute otherwise,
    saying nothing. One this version of TensorFlow cannot read is left out."""
    found: dict[str, Any] = {}
    for key, (read, _) in _TF_SETTINGS.items():
        with contextlib.suppress(Exception):
            found[key] = bool(getattr(config, read)())
    with contextlib.suppress(Exception):
        found["intra_op_threads"] = int(getattr(config, _TF_THREADS[0])())
    return found


def _set_tf_settings(config, saved: Any) -> None:
    """Put back each setting :func:`tf_settings` returned that differs now."""
    if not isinstance(saved, Mapping):
        return
    now = tf_settings(config)
    for key in (k for k, v in saved.items() if k in now and now[k] != v):
        with contextlib.suppress(Exception):  # (the thread pool, once TensorFlow ran an op: tf_threads_lost)
            if key == "op_determinism":
                (config.enable_op_determinism if saved[key] else config.disable_op_determinism)()
            elif key == "intra_op_threads":
                getattr(config, _TF_THREADS[1])(int(saved[key]))
            else:
                getattr(config, _TF_SETTINGS[key][1])(bool(saved[key]))


def tf_threads_lost(state: Mapping[str, Any]) -> tuple[int, int] | None:
    """Where :func:`capture_rng`'s ``state`` had another size of TensorFlow's intra-op thread pool
    than this process has, and TensorFlow here cannot take it (it ran an op): (then, now), after
    an attempt to set it; else None. A plain cell that set it (as advice for reproducible training
    on a CPU has it) is not run again in a new kernel, whose replay runs TensorFlow's first op
    with its default: the sums of one op split otherwise, and the resumed run computes otherwise."""
    config = sys.modules.get("tensorflow.python.framework.config")
    saved = state.get("tf_settings") if isinstance(state, Mapping) else None
    if config is None or not isinstance(saved, Mapping) or "intra_op_threads" not in saved:
        return None
    _set_tf_settings(config, {"intra_op_threads": saved["intra_op_threads"]})
    now = tf_settings(config).get("intra_op_threads")
    return None if now is None or now == saved["intra_op_threads"] else (int(saved["intra_op_threads"]), now)


# JAX's flags that change what a computation gives (each in its jit cache key, so a function traced
# before is traced again under the value put back): the random bits a key gives
# (``jax_threefry_partitionable``, whose default changed in JAX 0.5; its changelog advises setting
# it to False for the old numbers), what ``jax.random.key(seed)`` makes (the implementation and a
# seed offset), the default matmul precision (TF32 or bfloat16 passes on a GPU) and the softmax's
# gradient. ``jax_enable_x64`` is not one: it decides the dtype of the arrays the replayed cells
# made before any restore, and a saved float64 array JAX would make float32 is refused instead
# (checkpoints.restore)
_JAX_SETTINGS = ("jax_threefry_partitionable", "jax_default_prng_impl", "jax_random_seed_offset",
                 "jax_default_matmul_precision", "jax_softmax_custom_jvp")


def _jax_config():
    """JAX's config, if JAX is imported (None otherwise)."""
    jax = sys.modules.get("jax")
    return getattr(jax, "config", None) if jax is not None else None


def jax_settings(config) -> dict[str, Any]:
    """JAX's process-wide flags of :data:`_JAX_SETTINGS`, read through ``jax.config``. A cell that
    is not ``%%replay`` may set them (``jax.config.update("jax_threefry_partitionable", False)``),
    and a new kernel has JAX's defaults: the resumed run would draw other numbers, saying nothing.
    A flag this version of JAX does not have, or whose value is not a plain one, is left out."""
    found: dict[str, Any] = {}
    for name in _JAX_SETTINGS:
        with contextlib.suppress(Exception):
            value = getattr(config, name)
            if value is None or isinstance(value, (bool, int, str)):
                found[name] = value
    return found


def _set_jax_settings(config, saved: Any) -> None:
    """Put back each flag :func:`jax_settings` returned that differs now."""
    if not isinstance(saved, Mapping):
        return
    now = jax_settings(config)
    for name in (k for k, v in saved.items() if k in now and now[k] != v):
        with contextlib.suppress(Exception):
            config.update(name, saved[name])


def _keras_3() -> bool:
    keras = sys.modules.get("keras")
    return keras is not None and hasattr(keras, "Layer")


def keras_seed_generator(create: bool = False):
    """Keras's global ``SeedGenerator`` (what ``keras.random`` calls without a seed draw from, and
    layers made without one), if Keras 3 is imported and it exists (or ``create``)."""
    if "keras" not in sys.modules:
        return None
    try:
        from keras.src.backend.common import global_state
        from keras.src.random import seed_generator
    except ImportError:
        return None
    found = global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)
    return found if found is not None or not create else seed_generator.global_seed_generator()


def _tf_context():
    """TensorFlow's eager context, if TensorFlow is imported (None otherwise)."""
    context = sys.modules.get("tensorflow.python.eager.context")
    return context.context() if context is not None else None


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back what :func:`capture_rng` returned (CUDA states for the devices that exist)."""
    import random

    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "tensorflow" in state:
        tf = _tf_context()
        if tf is not None:
            # as tf.random.set_seed does, which also empties the cache of eager kernels: a cached
            # kernel of a random op keeps drawing where it stopped, and an op seed drawn again
            # (a retry in this process) must start its numbers afresh, as it did the first time
            tf._set_global_seed(state["tensorflow"]["seed"])
            tf._rng.setstate(state["tensorflow"]["rng"])
    if "tf_settings" in state:
        config = sys.modules.get("tensorflow.python.framework.config")
        if config is not None:
            _set_tf_settings(config, state["tf_settings"])
    if "jax_settings" in state:
        config = _jax_config()
        if config is not None:
            _set_jax_settings(config, state["jax_settings"])
    made_since = "keras" in state and state["keras"] is None and keras_seed_generator() is not None
    if "keras" in state and state["keras"] is not None:
        seeds = keras_seed_generator(create=True)
        if seeds is not None:
            seeds.state.assign(state["keras"])
    if "torch" in state or "cuda" in state:
        import torch

        if "torch_settings" in state:  # a checkpoint of an earlier version has none
            _set_torch_settings(torch, state["torch_settings"])
        if "torch" in state:
            torch.set_rng_state(state["torch"].contiguous())
        cuda = state.get("cuda") or []
        if cuda:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            for i, s in enumerate(cuda[:count]):
                torch.cuda.set_rng_state(s.contiguous(), i)
            if len(cuda) > count:
                warnings.warn(
                    f"colab_resilience: the checkpoint holds random states of {len(cuda)} CUDA "
                    f"devices; this machine has {count}; the others were not restored",
                    CheckpointWarning,
                    stacklevel=3,
                )
    if made_since:
        # made after the safe point, from Python's random state then, and captured by what was
        # traced since (a tf.function): no state makes it unmade; a new kernel's is (the rest of
        # the random states are back)
        from ..errors import BuiltSinceError

        raise BuiltSinceError("colab_resilience: Keras's global seed generator (keras.random without a seed) "
                              "was made after the safe point, and no saved state unmakes it")


def to_json(state: Mapping[str, Any]) -> dict[str, Any]:
    """A random state (:func:`capture_rng`, with generators' states) as JSON for a run's journal:
    tagged JSON (:mod:`.codec`) whose tensors and arrays are listed beside it by dtype, shape and
    bytes. Reading it back (:func:`from_json`) executes nothing."""
    import base64

    from .codec import Encoder

    encoder = Encoder(leaves=True)
    value = encoder.encode(dict(state))
    leaves = []
    for leaf in encoder.leaves:
        torch = sys.modules.get("torch")
        is_torch = torch is not None and isinstance(leaf, torch.Tensor)
        array = leaf.detach().cpu().contiguous().numpy() if is_torch else __import__("numpy").ascontiguousarray(leaf)
        leaves.append({"torch": is_torch, "dtype": array.dtype.str, "shape": list(array.shape),
                       "data": base64.b64encode(array.tobytes()).decode("ascii")})
    return {"value": value, "leaves": leaves}


def from_json(data: Mapping[str, Any]) -> dict[str, Any]:
    """The random state :func:`to_json` wrote (ValueError, or another error of malformed input,
    if it is not that)."""
    import base64

    import numpy as np

    from .codec import decode

    leaves = []
    for leaf in data["leaves"]:
        array = np.frombuffer(base64.b64decode(leaf["data"], validate=True), dtype=np.dtype(leaf["dtype"]))
        array = array.reshape([int(n) for n in leaf["shape"]]).copy()
        if leaf["torch"]:
            import torch

            leaves.append(torch.from_numpy(array))
        else:
            leaves.append(array)
    state = decode(data["value"], leaves)
    if not isinstance(state, dict):
        raise ValueError("a random state is not a mapping")
    return state
