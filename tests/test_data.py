"""The stdlib code corpus: deterministic, file-disjoint split."""

from kvarn_mla.evaluation import data as D


def test_split_is_a_fixed_function_of_the_path():
    assert D.code_split("json/decoder.py") == D.code_split("json/decoder.py")
    paths = [f"pkg{i}/mod{i}.py" for i in range(4000)]
    held = [p for p in paths if D.code_split(p) == "held_out"]
    assert abs(len(held) / len(paths) - D.CODE_HELD_OUT_PERCENT / 100) < 0.015


def test_read_code_files_on_a_tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "site-packages" / "x").mkdir(parents=True)
    (tmp_path / "__pycache__").mkdir()
    for i in range(60):
        (tmp_path / "pkg" / f"m{i}.py").write_text(f"x = {i}\n")
    (tmp_path / "site-packages" / "x" / "skip.py").write_text("y = 1\n")
    (tmp_path / "__pycache__" / "skip.py").write_text("y = 1\n")
    (tmp_path / "pkg" / "latin1.py").write_bytes(b"s = '\xe9'\n")
    (tmp_path / "pkg" / "empty.py").write_text("\n")
    train = D.read_code_files("train", tmp_path)
    held = D.read_code_files("held_out", tmp_path)
    paths = [f.path for f in train + held]
    assert sorted(paths) == sorted(f"pkg/m{i}.py" for i in range(60))
    assert not {f.path for f in train} & {f.path for f in held}
    assert [f.path for f in train] == sorted(f.path for f in train)
    assert all(D.code_split(f.path) == "held_out" for f in held)
    assert train == D.read_code_files("train", tmp_path)


def test_real_stdlib_has_both_splits():
    held = D.read_code_files("held_out")
    assert len(held) > 20
    assert all(D.code_split(f.path) == "held_out" and not f.path.startswith("site-packages") for f in held)
    assert D.corpus_info()["stdlib"] == str(D.stdlib_root())


def test_code_root_override_reads_the_copy(tmp_path, monkeypatch):
    # a run on another machine reads a copied stdlib through KVARN_MLA_CODE_ROOT, and says so in its metrics
    (tmp_path / "pkg").mkdir()
    for i in range(60):
        (tmp_path / "pkg" / f"m{i}.py").write_text(f"x = {i}\n")
    monkeypatch.setenv(D.CODE_ROOT_ENV, str(tmp_path))
    assert D.stdlib_root() == tmp_path
    assert D.read_code_files("train") == D.read_code_files("train", tmp_path)
    assert D.corpus_info()["code_root_override"] and D.corpus_info()["stdlib"] == str(tmp_path)
    monkeypatch.delenv(D.CODE_ROOT_ENV)
    assert D.stdlib_root() != tmp_path and not D.corpus_info()["code_root_override"]
