"""Implementation names as the campaign records them (fuzz/backend_names.py): a file name becomes
the same string from any working directory."""

from backends.registry import REPO
from fuzz import backend_names


def test_builtin_and_module_names_are_kept():
    for name in ("triton", "reference", "pkg.module:impl"):
        assert backend_names.canonical(name) == backend_names.loadable(name) == name


def test_relative_file_outside_the_repository_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert backend_names.canonical("k/my_kernel.py:impl") == f"{tmp_path.resolve()}/k/my_kernel.py:impl"
    assert backend_names.canonical("my_kernel.py:impl", base=tmp_path / "x") == (
        f"{(tmp_path / 'x').resolve()}/my_kernel.py:impl"
    )


def test_file_inside_the_repository_is_recorded_relative_to_its_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = backend_names.canonical(f"{REPO}/examples/head_major_kernel.py:impl")
    assert name == "examples/head_major_kernel.py:impl"
    assert backend_names.loadable(name) == f"{REPO}/examples/head_major_kernel.py:impl"
    assert backend_names.canonical(backend_names.loadable(name)) == name


def test_slug_is_a_file_name():
    assert backend_names.slug("/a/b/my_kernel.py:impl") == "my_kernel-impl"
    assert backend_names.slug("pkg.module:impl") == "pkg.module-impl"
    assert backend_names.slug("triton") == "triton"
