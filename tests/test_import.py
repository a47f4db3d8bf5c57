def test_package_imports():
    import quietsync

    assert quietsync.__version__
