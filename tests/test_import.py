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
