# Runs first in the sandbox's embedded interpreter: makes the opservant package (embedded in
# the binary, precompiled) importable ahead of anything on sys.path — an executor cannot
# shadow it — reports ready (the agent then applies the CPU quota), puts the executor's
# package and requirements on sys.path, and hands over to the runtime.
import marshal
import sys

import _opservant


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
        from importlib.machinery import ModuleSpec

        return ModuleSpec(name, _EmbeddedLoader(name, entry[0]), is_package=entry[1])


sys.meta_path.insert(0, _EmbeddedFinder)

import opservant._runtime  # noqa: E402

_opservant.ready()
sys.path[0:0] = _opservant.paths()
_opservant.exit(opservant._runtime.main())
