"""Every public function of the library's folders in ``SCOPE`` carries type hints: each parameter
(``self`` / ``cls`` of a method excepted) and the return (``__init__`` excepted). Public means a
name without a leading underscore (plus ``__init__``): module-level functions, and the methods
of public classes (nested public classes included). Functions defined inside functions are
helpers of their enclosing one and are not checked. The check reads the source (AST): nothing
is imported."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[1]

# Folders of the repository whose public functions must be annotated.
SCOPE = ("paged_kv", "pallas_kernels", "models")


def _is_public(name: str) -> bool:
    return not name.startswith("_") or name == "__init__"


def _missing(fn: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> list[str]:
    """Names of ``fn``'s unannotated parameters, and ``"return"`` when the return is unannotated."""
    args = fn.args
    params = args.posonlyargs + args.args
    skip_first = in_class and params and params[0].arg in ("self", "cls")
    named = params[1:] if skip_first else params
    missing = [a.arg for a in named + args.kwonlyargs if a.annotation is None]
    missing += [f"*{a.arg}" for a in (args.vararg,) if a is not None and a.annotation is None]
    missing += [f"**{a.arg}" for a in (args.kwarg,) if a is not None and a.annotation is None]
    if fn.returns is None and fn.name != "__init__":
        missing.append("return")
    return missing


def unannotated(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: function: missing`` (``file`` relative to ``root``) for each public function of
    ``path`` lacking a hint."""
    found = []

    def visit(body: list[ast.stmt], owner: str | None) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                # A module-level ``__init__`` is no constructor: only methods may use the name.
                if _is_public(node.name) and (owner is not None or node.name != "__init__"):
                    missing = _missing(node, owner is not None)
                    if missing:
                        name = f"{owner}.{node.name}" if owner else node.name
                        found.append(f"{path.relative_to(root)}:{node.lineno}: {name}: {', '.join(missing)}")
            elif isinstance(node, ast.ClassDef):
                if not node.name.startswith("_"):
                    visit(node.body, f"{owner}.{node.name}" if owner else node.name)
            else:  # functions defined in ``if`` / ``try`` / ``with`` blocks are public too
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, None) or [], owner)
                for handler in getattr(node, "handlers", None) or []:
                    visit(handler.body, owner)

    visit(ast.parse(path.read_text()).body, None)
    return found


@pytest.mark.parametrize("folder", SCOPE)
def test_public_functions_are_annotated(folder):
    paths = sorted((ROOT / folder).rglob("*.py"))
    assert paths, f"no Python files under {folder}/"
    missing = [line for path in paths for line in unannotated(path)]
    assert not missing, "public functions without type hints:\n" + "\n".join(missing)


def test_the_check_finds_what_it_should(tmp_path):
    """The walker itself: what it reports and what it leaves alone."""
    source = '''
def bare(a, b: int):
    def inner(x):  # nested: the enclosing function's business
        return x
    return inner
def full(a: int, *rest: str, key: bool = False, **kw: float) -> None: ...
def _private(a): ...
def star(*args, **kwargs) -> None: ...
class Public:
    def __init__(self, a): ...
    def method(self, b) -> int: ...
    @classmethod
    def build(cls) -> "Public": ...
    @staticmethod
    def helper(cls_like) -> None: ...
    def _hidden(self, c): ...
    class Inner:
        def deep(self): ...
class _Private:
    def method(self, a): ...
if True:
    def conditional(a) -> None: ...
'''
    path = tmp_path / "sample.py"
    path.write_text(source)
    found = [line.split(":", 2)[2].strip() for line in unannotated(path, tmp_path)]
    assert found == ["bare: a, return", "star: *args, **kwargs", "Public.__init__: a", "Public.method: b",
                     "Public.helper: cls_like", "Public.Inner.deep: return", "conditional: a"], found
