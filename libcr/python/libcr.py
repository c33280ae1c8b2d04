"""libcr for Python: a small ctypes binding to libcr.so (docs/API.md).

    import libcr
    libcr.init()
    libcr.register_callback(fn)        # fn() runs before every checkpoint,
                                       # in libcr's thread; it calls
                                       # libcr.checkpoint() -> 0 / > 0
    libcr.request_checkpoint(libcr.SCOPE_JOB)  # -> "continued" | "restarted"
    libcr.restart_info()               # dict after a restart, else None

libcr.so is, first found: $CR_LIBCR (a path), the libcr.so next to the
cr tools on PATH (cr_checkpoint's directory, as a build tree has it), or
"libcr.so" for the dynamic loader (LD_LIBRARY_PATH, the system's).
Errors raise LibcrError (OSError) with libcr's message.
"""
import ctypes
import os
import shutil

SCOPE_PROC, SCOPE_TREE, SCOPE_JOB = 0, 3, 4
THREAD_CONTEXT = 0x4000000
CR_ERESTARTED = 204
_ARGS_VERSION = 1


class LibcrError(OSError):
    pass


class _Args(ctypes.Structure):
    _fields_ = [
        ("cr_version", ctypes.c_int),
        ("cr_scope", ctypes.c_int),
        ("cr_target", ctypes.c_int),
        ("cr_fd", ctypes.c_int),
        ("cr_signal", ctypes.c_int),
        ("cr_timeout", ctypes.c_uint),
        ("cr_flags", ctypes.c_uint),
    ]


class _RestartInfo(ctypes.Structure):
    _fields_ = [
        ("requester", ctypes.c_int),
        ("src", ctypes.c_char_p),
        ("hostname_before", ctypes.c_char_p),
        ("hostname_now", ctypes.c_char_p),
        ("node_changed", ctypes.c_int),
        ("addresses_changed", ctypes.c_int),
        ("addresses_before", ctypes.c_char_p),
        ("addresses_now", ctypes.c_char_p),
    ]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
# Registered callbacks stay referenced: libcr calls them for ever.
_callbacks = []


def _find():
    path = os.environ.get("CR_LIBCR")
    if path:
        return path
    tool = shutil.which("cr_checkpoint")
    if tool:
        near = os.path.join(os.path.dirname(os.path.realpath(tool)), "libcr.so")
        if os.path.exists(near):
            return near
    return "libcr.so"


_lib = ctypes.CDLL(_find(), use_errno=True)
_lib.cr_init.restype = ctypes.c_int
_lib.cr_checkpoint.argtypes = [ctypes.c_int]
_lib.cr_register_callback.argtypes = [_CALLBACK, ctypes.c_void_p, ctypes.c_int]
_lib.cri_init_checkpoint_args_t.argtypes = [ctypes.c_int, ctypes.POINTER(_Args)]
_lib.cr_request_checkpoint.argtypes = [ctypes.POINTER(_Args), ctypes.POINTER(ctypes.c_ulong)]
_lib.cr_poll_checkpoint.argtypes = [ctypes.POINTER(ctypes.c_ulong), ctypes.c_void_p]
_lib.cr_strerror.restype = ctypes.c_char_p
_lib.cr_strerror.argtypes = [ctypes.c_int]
_lib.cr_get_restart_info.restype = ctypes.POINTER(_RestartInfo)


def _error(what):
    e = ctypes.get_errno()
    return LibcrError(e, f"{what}: {_lib.cr_strerror(e).decode()}")


def init():
    """cr_init: the process takes part in its checkpoints."""
    if _lib.cr_init() < 0:
        raise _error("cr_init")


def register_callback(fn):
    """Run fn() before every checkpoint (thread context). fn calls
    checkpoint() when ready; an exception refuses the checkpoint."""

    def call(_arg):
        try:
            fn()
            return 0
        except Exception:  # a refusal: the checkpointer names the callback
            return -1

    cb = _CALLBACK(call)
    _callbacks.append(cb)
    if _lib.cr_register_callback(cb, None, THREAD_CONTEXT) < 0:
        raise _error("cr_register_callback")


def checkpoint():
    """Inside a callback: 0 when the process continues, > 0 after a
    restart; raises when the checkpoint was cancelled."""
    rc = _lib.cr_checkpoint(0)
    if rc < 0:
        raise LibcrError(-rc, f"cr_checkpoint: {_lib.cr_strerror(-rc).decode()}")
    return rc


def request_checkpoint(scope=SCOPE_TREE):
    """Ask for a checkpoint of this process's tree (SCOPE_TREE) or of its
    whole cluster job (SCOPE_JOB) and wait for it: "continued" in the
    process that asked, "restarted" in a copy restarted from it."""
    args = _Args()
    _lib.cri_init_checkpoint_args_t(_ARGS_VERSION, ctypes.byref(args))
    args.cr_scope = scope
    handle = ctypes.c_ulong(0)
    if _lib.cr_request_checkpoint(ctypes.byref(args), ctypes.byref(handle)) != 0:
        raise _error("cr_request_checkpoint")
    rc = _lib.cr_poll_checkpoint(ctypes.byref(handle), None)
    if rc > 0:
        return "continued"
    if rc < 0 and ctypes.get_errno() == CR_ERESTARTED:
        return "restarted"
    raise _error("the requested checkpoint")


def restart_info():
    """After a restart: where from, and whether the node or its addresses
    changed; None before any restart."""
    p = _lib.cr_get_restart_info()
    if not p:
        return None
    r = p.contents
    s = lambda b: (b or b"").decode()
    return {
        "src": s(r.src),
        "hostname_before": s(r.hostname_before),
        "hostname_now": s(r.hostname_now),
        "node_changed": bool(r.node_changed),
        "addresses_changed": bool(r.addresses_changed),
        "addresses_before": s(r.addresses_before).split(),
        "addresses_now": s(r.addresses_now).split(),
    }
