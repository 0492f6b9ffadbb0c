import json
import os
import sys

import pytest

from opservant._lifecycle import load_executor_class
from opservant.executor import BaseExecutor

pytestmark = pytest.mark.usefixtures("clean_imports")

SIMPLE = """
from opservant.executor import BaseExecutor, ExecutorResult

class Simple(BaseExecutor):
    name = "simple"
    def validate(self, params):
        return True
    def execute(self, params, context):
        return ExecutorResult(output={"ok": True})

not_a_class = 42

class NoExecute:
    def validate(self, params):
        return True

class NotCallable:
    validate = "yes"
    execute = "yes"
"""


def test_loads_class_from_module(make_executor):
    d = make_executor({"ld_simple.py": SIMPLE}, "ld_simple.Simple")
    cls = load_executor_class("ld_simple.Simple", str(d))
    assert cls.__name__ == "Simple" and issubclass(cls, BaseExecutor)
    assert sys.path[0] == str(d)
    assert os.path.realpath(sys.modules["ld_simple"].__file__).startswith(os.path.realpath(str(d)))


def test_does_not_insert_package_dir_twice(make_executor):
    d = make_executor({"ld_twice.py": SIMPLE}, "ld_twice.Simple")
    sys.path.insert(0, str(d))
    before = list(sys.path)
    load_executor_class("ld_twice.Simple", str(d))
    assert sys.path == before


def test_dotted_module(make_executor):
    d = make_executor(
        {"ld_pkg/__init__.py": "", "ld_pkg/sub/__init__.py": "", "ld_pkg/sub/impl.py": SIMPLE},
        "ld_pkg.sub.impl.Simple",
    )
    assert load_executor_class("ld_pkg.sub.impl.Simple", str(d)).__name__ == "Simple"


def test_class_reexported_from_package_init(make_executor):
    d = make_executor(
        {"ld_reexp/__init__.py": "from .executor import Simple\n", "ld_reexp/executor.py": SIMPLE},
        "ld_reexp.Simple",
    )
    assert load_executor_class("ld_reexp.Simple", str(d)).__name__ == "Simple"


def test_missing_module(make_executor):
    d = make_executor({}, "ld_nowhere.Simple")
    with pytest.raises(ImportError, match="module 'ld_nowhere' not found in executor package"):
        load_executor_class("ld_nowhere.Simple", str(d))


def test_missing_submodule(make_executor):
    d = make_executor({"ld_half/__init__.py": ""}, "ld_half.nothere.Simple")
    with pytest.raises(ImportError, match="module 'ld_half.nothere' not found"):
        load_executor_class("ld_half.nothere.Simple", str(d))


def test_missing_dependency_propagates_unchanged(make_executor):
    d = make_executor({"ld_dep.py": "import ld_no_such_dependency\n"}, "ld_dep.X")
    with pytest.raises(ModuleNotFoundError) as info:
        load_executor_class("ld_dep.X", str(d))
    assert info.value.name == "ld_no_such_dependency"


def test_syntax_error_in_module_propagates(make_executor):
    d = make_executor({"ld_syntax.py": "def broken(:\n"}, "ld_syntax.X")
    with pytest.raises(SyntaxError):
        load_executor_class("ld_syntax.X", str(d))


def test_missing_class(make_executor):
    d = make_executor({"ld_nocls.py": SIMPLE}, "ld_nocls.Missing")
    with pytest.raises(AttributeError, match="has no attribute 'Missing'"):
        load_executor_class("ld_nocls.Missing", str(d))


def test_not_a_class(make_executor):
    d = make_executor({"ld_notcls.py": SIMPLE}, "ld_notcls.not_a_class")
    with pytest.raises(TypeError, match="is a int, not a class"):
        load_executor_class("ld_notcls.not_a_class", str(d))


def test_class_without_execute(make_executor):
    d = make_executor({"ld_noexec.py": SIMPLE}, "ld_noexec.NoExecute")
    with pytest.raises(TypeError, match="lacks callable execute"):
        load_executor_class("ld_noexec.NoExecute", str(d))


def test_class_with_non_callable_methods(make_executor):
    d = make_executor({"ld_noncall.py": SIMPLE}, "ld_noncall.NotCallable")
    with pytest.raises(TypeError, match="lacks callable validate and execute"):
        load_executor_class("ld_noncall.NotCallable", str(d))


def test_duck_typed_class_accepted(make_executor):
    src = (
        "class Duck:\n"
        "    def validate(self, params):\n        return True\n"
        "    def execute(self, params, context):\n        return None\n"
    )
    d = make_executor({"ld_duck.py": src}, "ld_duck.Duck")
    cls = load_executor_class("ld_duck.Duck", str(d))
    assert cls.__name__ == "Duck" and not issubclass(cls, BaseExecutor)


@pytest.mark.parametrize("entry", ["NoModule", "", ".rel.Class", "a..B", "mod.", "mod.Cl ass", "1mod.C", None])
def test_malformed_entry_point(make_executor, entry):
    d = make_executor({}, "x.Y")
    with pytest.raises(ImportError, match="entry_point"):
        load_executor_class(entry, str(d))


def test_missing_package_dir(tmp_path):
    with pytest.raises(ImportError, match="does not exist"):
        load_executor_class("m.C", str(tmp_path / "absent"))


# --- the entry point must resolve inside the package -------------------------------------------

def test_refuses_stdlib_module_already_imported(make_executor):
    d = make_executor({}, "json.JSONDecoder")
    assert "json" in sys.modules
    with pytest.raises(ImportError, match="outside the executor package"):
        load_executor_class("json.JSONDecoder", str(d))


def test_refuses_stdlib_module_not_yet_imported(make_executor):
    name = "colorsys"
    sys.modules.pop(name, None)
    d = make_executor({}, "%s.Anything" % name)
    with pytest.raises(ImportError, match="outside the executor package"):
        load_executor_class("%s.Anything" % name, str(d))


def test_refuses_dotted_stdlib_module(make_executor):
    d = make_executor({}, "email.message.Message")
    with pytest.raises(ImportError, match="outside the executor package"):
        load_executor_class("email.message.Message", str(d))


def test_refuses_builtin_module(make_executor):
    d = make_executor({}, "sys.flags")
    with pytest.raises(ImportError, match="resolves to a built-in or namespace module, outside"):
        load_executor_class("sys.flags", str(d))


def test_refuses_module_found_outside_on_sys_path(make_executor, tmp_path):
    d = make_executor({}, "ld_elsewhere.Simple")
    other = tmp_path / "other"
    other.mkdir()
    (other / "ld_elsewhere.py").write_text(SIMPLE)
    sys.path.append(str(other))
    with pytest.raises(ImportError, match="outside the executor package"):
        load_executor_class("ld_elsewhere.Simple", str(d))


def test_refuses_stdlib_named_module_shadowed_by_cache(make_executor):
    # The package has its own json.py, but "json" is already the standard library's module.
    d = make_executor({"json.py": SIMPLE.replace("class Simple", "class JSONDecoder")}, "json.JSONDecoder")
    with pytest.raises(ImportError, match="outside the executor package"):
        load_executor_class("json.JSONDecoder", str(d))
    assert sys.modules["json"] is json


def test_refuses_module_of_same_name_imported_from_another_dir(make_executor, tmp_path):
    first = make_executor({"ld_same.py": SIMPLE}, "ld_same.Simple", dirname="first")
    second = make_executor({"ld_same.py": SIMPLE}, "ld_same.Simple", dirname="second")
    load_executor_class("ld_same.Simple", str(first))
    with pytest.raises(ImportError, match="outside the executor package"):
        load_executor_class("ld_same.Simple", str(second))


def test_refuses_symlink_escaping_package(make_executor, tmp_path):
    outside = tmp_path / "outside.py"
    outside.write_text(SIMPLE)
    d = make_executor({}, "ld_link.Simple")
    os.symlink(str(outside), str(d / "ld_link.py"))
    with pytest.raises(ImportError, match="outside the executor package"):
        load_executor_class("ld_link.Simple", str(d))


def test_sibling_directory_with_common_prefix_is_outside(make_executor, tmp_path):
    d = make_executor({}, "ld_prefix.Simple", dirname="pkg")
    sib = tmp_path / "pkg2"
    sib.mkdir()
    (sib / "ld_prefix.py").write_text(SIMPLE)
    sys.path.append(str(sib))
    with pytest.raises(ImportError, match="outside the executor package"):
        load_executor_class("ld_prefix.Simple", str(d))


def test_package_dir_given_through_symlink(make_executor, tmp_path):
    d = make_executor({"ld_symdir.py": SIMPLE}, "ld_symdir.Simple")
    link = tmp_path / "link"
    os.symlink(str(d), str(link))
    assert load_executor_class("ld_symdir.Simple", str(link)).__name__ == "Simple"


def test_relative_package_dir(make_executor, monkeypatch):
    d = make_executor({"ld_rel.py": SIMPLE}, "ld_rel.Simple")
    monkeypatch.chdir(str(d.parent))
    assert load_executor_class("ld_rel.Simple", d.name).__name__ == "Simple"
    assert sys.path[0] == str(d)
