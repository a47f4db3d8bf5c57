def test_package_imports():
    import quietsync

    assert quietsync.__version__


def test_an_older_torch_is_refused_in_one_line():
    import pytest

    from quietsync._versions import check_torch

    check_torch("2.13.0+cpu")
    check_torch("2.14.1")
    with pytest.raises(ImportError,
                       match=r"^quietsync needs torch >= 2\.13, found 2\.12\.1\+cu121: pip install") as got:
        check_torch("2.12.1+cu121")
    assert "\n" not in str(got.value)


def test_the_command_list_and_version_answer_without_importing_torch():
    """``quietsync --help`` and ``--version`` load no torch (seconds of start-up); the version check reads torch's
    installed metadata, which agrees with the imported torch."""
    import subprocess
    import sys

    code = ("import sys; from quietsync.commands.main import main; main(['--help']); main(['--version']); "
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert "commands:" in proc.stdout and proc.stdout.splitlines()[-1] == "False", proc.stdout

    import torch

    from quietsync._versions import installed_torch

    assert installed_torch() == torch.__version__


def test_a_torch_without_metadata_is_imported_for_its_version(monkeypatch):
    """A torch on the path without installed metadata (a source checkout): the version check imports it."""
    import importlib.metadata

    import torch

    from quietsync._versions import installed_torch

    def none(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", none)
    assert installed_torch() == torch.__version__
