# Runs first in the sandbox's embedded interpreter: makes the opservant package (embedded in
# the binary, precompiled) importable ahead of anything on sys.path — an executor cannot
# shadow it — and hands over to the runtime, which puts the executor's package and
# requirements on sys.path and reports ready just before the first untrusted code runs (the
# agent applies the CPU quota and answers; the runtime waits for the answer).
import gc
import marshal
import sys

import _opservant

# No collections during the runtime's own start-up (its objects live as long as the
# process); the runtime re-enables the collector, with these objects frozen out of it,
# before executor code runs.
gc.disable()


class _EmbeddedLoader:
    def __init__(self, name, code):
        self.name = name
        self.code = code

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        exec(marshal.loads(self.code), module.__dict__)


class _EmbeddedFinder:
    sources = _opservant.sources()

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        entry = cls.sources.get(name)
        if entry is None:
            return None
        from _frozen_importlib import ModuleSpec  # already loaded; `importlib` is not

        return ModuleSpec(name, _EmbeddedLoader(name, entry[0]), is_package=entry[1])


sys.meta_path.insert(0, _EmbeddedFinder)

import opservant._runtime  # noqa: E402

if _opservant.zygote():
    # Everything above ran once; each sandbox is a fork of this process that returns from
    # zygote_serve with every restriction in place. Nothing here may hold a secret or
    # executor code: only the standard library and the embedded runtime are loaded.
    # `os` (~1.4 ms: stat, posixpath, _collections_abc) is imported once, here; its
    # `environ` is the zygote's (empty) environment until the child replaces it below.
    import os

    # The interpreter's first compile() of source initialises the parser (~0.8 ms, measured
    # with Debian's 3.11); done here, once, instead of in every child that imports an
    # executor's module from source.
    compile("pass", "<opservant warm-up>", "exec")

    # The C module (`signal` imports enum, functools and collections — ~4.6 ms in every
    # child, measured with `opservant bench`, issue 6), imported here: importing it reads
    # every signal's disposition (64 sigaction calls, ~0.3 ms in a sandbox child). What it
    # read is the zygote's; each child corrects it below.
    import _signal as signal

    gc.freeze()
    env = _opservant.zygote_serve()
    if env is None:
        _opservant.exit(0)

    # The run's environment, as a freshly started interpreter has it.
    os.environ.clear()
    os.environ.update(env)
    del env, os
else:
    import _signal as signal

# The signal dispositions a freshly started `python3` has, and `signal`'s view of them in
# line with the process: Ctrl-C as KeyboardInterrupt, SIGPIPE and SIGXFSZ ignored (errors
# instead of death), everything else at its default. Not what this program's start left
# (Rust's stack-overflow handlers on SIGSEGV and SIGBUS, SIGPIPE ignored), nor, through a
# zygote, what `signal` read in the zygote (a child starts with every signal at its default).
for signum in range(1, signal.NSIG):
    if signal.getsignal(signum) is not signal.SIG_DFL:
        try:
            signal.signal(signum, signal.SIG_DFL)
        except OSError:
            pass  # 32 and 33, the C library's own: shown as None, as in any interpreter
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGPIPE, signal.SIG_IGN)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
del signal

_opservant.exit(opservant._runtime.main())
