"""The documentation's generated parts agree with the code (the docs build checks the
same, scripts/build_docs.sh; these run without MkDocs)."""
import importlib.util
import os
import re


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_environment_variable_is_described():
    assert _load("docs_env").check(ROOT) == []


def test_scan_finds_the_variables_and_the_horovod_aliases():
    names, aliases = _load("docs_env").scan(ROOT)
    assert {"HVDLITE_FUSION_THRESHOLD", "HVDLITE_PEER_TIMEOUT", "HVDLITE_MPI_DIR"} <= names
    assert "HVDLITE_ERR_MISMATCH" not in names and "HVDLITE_FLOAT32" not in names
    assert aliases["HVDLITE_FUSION_THRESHOLD"] == ["HOROVOD_FUSION_THRESHOLD"]
    assert aliases["HVDLITE_HIERARCHICAL_ALLREDUCE"] == ["HOROVOD_HIERARCHICAL_ALLREDUCE"]


def test_troubleshooting_has_a_section_per_error_class():
    import hvdlite.errors as errors

    with open(os.path.join(ROOT, "docs", "troubleshooting.md"), encoding="utf-8") as f:
        text = f.read()
    classes = {c.__name__ for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, BaseException)
               and c.__module__ == errors.__name__}
    assert classes and not {c for c in classes if f"## `{c}`" not in text}


def test_readme_starts_with_the_two_quick_start_commands():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    commands = re.findall(r"```bash\n(.*?)\n", text)
    assert commands[:2] == [
        "bash scripts/setup_venv.sh && .venv/bin/hvdliterun -np 2 .venv/bin/python "
        "examples/pytorch_digits.py",
        "bash scripts/test.sh"]
    assert len(text.splitlines()) <= 200


def test_readme_links_point_at_files_of_the_repository():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    targets = [t for t in re.findall(r"\]\(([^)#]+)", text) if "://" not in t]
    missing = [t for t in targets if not os.path.exists(os.path.join(ROOT, t))]
    assert targets and not missing, missing
