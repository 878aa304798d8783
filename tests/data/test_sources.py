"""Data sources beyond one file: a folder of shards, a hub id (mocked: no hub here), and
``data.system_prompt``."""

from __future__ import annotations

import json

import pytest

from cispo.config.train import DataConfig, ModelConfig
from cispo.config.train import TrainConfig as Config
from cispo.data.datasets import DataError, load_prompts


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def rows(lo, hi):
    return [{"q": f"q{i}", "a": str(i)} for i in range(lo, hi)]


def test_folder_of_jsonl_and_parquet_shards_in_sorted_order(tmp_path):
    write_jsonl(tmp_path / "shards" / "part-0.jsonl", rows(0, 2))
    write_parquet(tmp_path / "shards" / "part-1.parquet", rows(2, 4))
    write_jsonl(tmp_path / "shards" / "more" / "part-2.jsonl", rows(4, 5))
    (tmp_path / "shards" / "README.md").write_text("not a shard")
    (tmp_path / "shards" / ".hidden.jsonl").write_text("not json\n")
    got = load_prompts(tmp_path / "shards", prompt_field="q", answer_field="a")
    assert [s["prompt"] for s in got] == ["q4", "q0", "q1", "q2", "q3"]  # 'more/part-2' sorts first


def test_shard_errors_name_the_shard_line_and_field(tmp_path):
    write_jsonl(tmp_path / "d" / "a.jsonl", rows(0, 3))
    bad = rows(3, 6)
    del bad[1]["a"]
    write_jsonl(tmp_path / "d" / "b.jsonl", bad)
    with pytest.raises(DataError, match=r"d/b\.jsonl: line 2: field 'a': missing answer field"):
        load_prompts(tmp_path / "d", prompt_field="q", answer_field="a")
    write_parquet(tmp_path / "p" / "x.parquet", [{"q": "", "a": "1"}])
    with pytest.raises(DataError, match=r"p/x\.parquet: row 0: field 'q': empty prompt"):
        load_prompts(tmp_path / "p", prompt_field="q", answer_field="a")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no shards"):
        load_prompts(tmp_path / "empty")


def test_script_free_hub_layout_folder_splits(tmp_path):
    """A folder laid out like a script-free hub repository: split-named shards under data/."""
    root = tmp_path / "repo"
    write_parquet(root / "data" / "train-00000-of-00002.parquet", rows(0, 3))
    write_parquet(root / "data" / "train-00001-of-00002.parquet", rows(3, 5))
    write_jsonl(root / "data" / "test.jsonl", rows(10, 12))
    (root / "README.md").write_text("---\nlicense: mit\n---\n")
    train = load_prompts(root, prompt_field="q", answer_field="a", split="train")
    assert [s["answer"] for s in train] == ["0", "1", "2", "3", "4"]
    assert [s["prompt"] for s in load_prompts(root, prompt_field="q", answer_field="a", split="test")] == ["q10", "q11"]
    with pytest.raises(DataError, match="holds shards of splits test, train: pass split"):
        load_prompts(root, prompt_field="q", answer_field="a")
    with pytest.raises(DataError, match=r"no shards of split 'tran' \(did you mean 'train'\?\)"):
        load_prompts(root, prompt_field="q", answer_field="a", split="tran")
    # the same folder through datasets.load_dataset gives the same training rows
    datasets = pytest.importorskip("datasets")
    ref = datasets.load_dataset(str(root / "data"), data_files={"train": "train-*.parquet"}, split="train")
    assert [r["a"] for r in ref] == [s["answer"] for s in train]


def test_folder_split_by_subfolder(tmp_path):
    write_jsonl(tmp_path / "d" / "train" / "0.jsonl", rows(0, 2))
    write_jsonl(tmp_path / "d" / "validation" / "0.jsonl", rows(5, 6))
    assert len(load_prompts(tmp_path / "d", prompt_field="q", answer_field="a", split="validation")) == 1


class FakeDataset:
    def __init__(self, rows):
        self.rows = rows
        self.column_names = list(rows[0])

    def select_columns(self, cols):
        return FakeDataset([{c: r[c] for c in cols} for r in self.rows])

    def with_format(self, fmt):
        assert fmt == "arrow"
        return self

    def iter(self, batch_size):
        import pyarrow as pa

        yield pa.Table.from_pylist(self.rows)


def test_hub_id_goes_to_load_dataset_with_name_and_split(monkeypatch):
    pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kw):
        calls.append((path, name, split, kw))
        return FakeDataset([{"question": "q0", "answer": "1"}, {"question": "q1", "answer": None}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    got = load_prompts("openai/gsm8k", prompt_field="question", name="main", split="test", on_error="skip")
    assert calls == [("openai/gsm8k", "main", "test", {})]
    assert got == [{"prompt": "q0", "answer": "1"}]
    with pytest.raises(DataError, match=r"openai/gsm8k: row 1: field 'answer': answer is null"):
        load_prompts("openai/gsm8k", prompt_field="question", name="main", split="test")
    with pytest.raises(DataError, match="needs a split"):
        load_prompts("openai/gsm8k", prompt_field="question")
    assert len(calls) == 2  # no call without a split

    def failing(*a, **kw):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", failing)
    with pytest.raises(DataError, match=r"nobody/nothing: no such file or directory, and datasets\.load_dataset "
                                        r"failed: ConnectionError: offline"):
        load_prompts("nobody/nothing", split="train")


def test_missing_local_paths_are_not_hub_ids(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file or directory$"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="does not apply to a local file"):
        load_prompts(write_jsonl(tmp_path / "ok.jsonl", rows(0, 1)), prompt_field="q", answer_field="a", name="main")


def test_load_source_passes_name_and_split(monkeypatch):
    import cispo.data.datasets as cispo_datasets
    from cispo.data.prompts import load_source

    seen = {}

    def fake_load_prompts(path, **kw):
        seen.update(kw, path=path)
        return [{"prompt": f"p{i}", "answer": "1"} for i in range(10)]

    monkeypatch.setattr(cispo_datasets, "load_prompts", fake_load_prompts)
    cfg = DataConfig(path="openai/gsm8k", name="main", split="train", reward="exact_match", num_eval_prompts=2)
    src = load_source(cfg, max_new_tokens=8)
    assert (seen["path"], seen["name"], seen["split"]) == ("openai/gsm8k", "main", "train")
    assert len(src.train) == 8 and len(src.eval) == 2


def test_system_prompt_needs_chat_template():
    with pytest.raises(ValueError, match=r"data\.system_prompt.*model\.chat_template=auto or true, not false"):
        Config(model=ModelConfig(chat_template=False), data=DataConfig(system_prompt="Be brief."))
    for setting in (True, "auto"):  # auto (the default) turns the template on for a system prompt
        cfg = Config(model=ModelConfig(chat_template=setting), data=DataConfig(system_prompt="Be brief."))
        assert cfg.data.system_prompt == "Be brief."


def test_chat_template_is_true_false_or_auto(tmp_path):
    """Default auto; old configs' true / false still read, from YAML and the command line; a wrong
    value is one line naming the field and its choices."""
    from cispo.config.train import ConfigError, apply_overrides, load_yaml

    assert Config().model.chat_template == "auto"
    for text, value in (("true", True), ("false", False), ("auto", "auto")):
        assert apply_overrides(Config(), [f"model.chat_template={text}"]).model.chat_template == value
        (tmp_path / "c.yaml").write_text(f"model:\n  chat_template: {text}\n")
        assert load_yaml(Config, tmp_path / "c.yaml").model.chat_template == value
    with pytest.raises(ConfigError) as e:
        apply_overrides(Config(), ["model.chat_template=atuo"])
    assert str(e.value) == ("override 'model.chat_template=atuo': model.chat_template: expected bool | "
                            "Literal['auto'], got 'atuo'")


def test_chat_samples_are_found_in_every_file_of_the_run(tmp_path):
    """Which files hold chat-message prompts (what model.chat_template=auto turns the template on for):
    the training file, data.eval_path and each eval set, each named."""
    from cispo.config.data import EvalSetConfig
    from cispo.data.prompts import chat_samples, load_eval_sets, load_source

    chat = [{"role": "user", "content": "hi"}]
    text = write_jsonl(tmp_path / "text.jsonl", [{"prompt": f"p{i}", "answer": "1"} for i in range(6)])
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"prompt": chat, "answer": "1"}] * 5)
    for kw, found in (({}, {}), ({"eval_path": str(chats)}, {str(chats): 5}),
                      ({"eval_sets": {"c": EvalSetConfig(path=str(chats))}}, {str(chats): 5})):
        cfg = DataConfig(path=str(text), reward="exact_match", **kw)
        source = load_source(cfg, max_new_tokens=4)
        got = chat_samples(cfg, source, load_eval_sets(cfg))
        assert {path: len(samples) for path, samples in got.items()} == found
    cfg = DataConfig(path=str(chats), reward="exact_match", num_eval_prompts=1)  # 4 training rows, 1 held out
    assert {p: len(s) for p, s in chat_samples(cfg, load_source(cfg, 4), {}).items()} == {str(chats): 5}
    assert chat_samples(DataConfig(), None, {}) == {}  # a built-in task: Task.chat says


def test_system_prompt_override_and_yaml(tmp_path):
    from cispo.config.train import apply_overrides, load_yaml

    y = tmp_path / "c.yaml"
    y.write_text("model:\n  chat_template: true\ndata:\n  system_prompt: Think step by step.\n")
    assert load_yaml(Config, y).data.system_prompt == "Think step by step."
    cfg = apply_overrides(Config(), ["model.chat_template=true", "system_prompt=Be brief.", "data.name=main"])
    assert (cfg.data.system_prompt, cfg.data.name) == ("Be brief.", "main")


class RecordingTokenizer:
    def __init__(self):
        self.messages = None

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        self.messages = messages
        return [1, 2]


def test_policy_prepends_system_prompt_in_chat_mode():
    from cispo.models.policy import Policy

    tok = RecordingTokenizer()
    policy = Policy(model=None, tokenizer=tok, sampler=None, device=None, chat_template=True, system_prompt="Be brief.")
    policy.encode({"prompt": "hi"})
    assert tok.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    own = [{"role": "system", "content": "row's own"}, {"role": "user", "content": "hi"}]
    policy.encode({"prompt": "hi", "messages": own})
    assert tok.messages == own  # a row's own system message wins
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    policy.encode({"prompt": "c", "messages": chat})
    assert tok.messages == [{"role": "system", "content": "Be brief."}, *chat]


# --------------------------------------------------------------------------- data.eval_sets


def file_data(**kw):
    return DataConfig(path="train.jsonl", reward="exact_match", **kw)


def test_eval_sets_from_yaml_and_overrides(tmp_path):
    from cispo.config.train import ConfigError, EvalSetConfig, apply_overrides, load_yaml, save_yaml

    y = tmp_path / "c.yaml"
    y.write_text("model:\n  path: /m\ndata:\n  path: train.jsonl\n  reward: math\n  eval_sets:\n"
                 "    gsm8k: {path: gsm8k.jsonl, prompt_field: question, num_prompts: 50}\n"
                 "    math500:\n      path: math500.parquet\n      answer_field: solution\n"
                 "rollout:\n  max_new_tokens: 8\n")
    cfg = load_yaml(Config, y)
    assert cfg.data.eval_sets == {
        "gsm8k": EvalSetConfig(path="gsm8k.jsonl", prompt_field="question", num_prompts=50),
        "math500": EvalSetConfig(path="math500.parquet", answer_field="solution")}
    save_yaml(cfg, tmp_path / "again.yaml")
    assert load_yaml(Config, tmp_path / "again.yaml") == cfg
    cfg2 = apply_overrides(cfg, ["data.eval_sets.gsm8k.split=test", "data.eval_sets.aime={path: aime.jsonl}"])
    assert cfg2.data.eval_sets["gsm8k"].split == "test" and cfg2.data.eval_sets["gsm8k"].prompt_field == "question"
    assert cfg2.data.eval_sets["aime"] == EvalSetConfig(path="aime.jsonl")
    with pytest.raises(ConfigError, match=r"data\.eval_sets\.gsm8k\.promt_field.*unknown key"):
        apply_overrides(cfg, ["data.eval_sets.gsm8k.promt_field=q"])
    with pytest.raises(ConfigError, match=r"data\.eval_sets\.x\.path"):
        apply_overrides(cfg, ["data.eval_sets.x={prompt_field: q}"])  # path is required
    with pytest.raises(ConfigError, match=r"data\.eval_sets\.a/b is not a usable set name"):
        apply_overrides(cfg, ["data.eval_sets.a/b={path: x.jsonl}"])
    with pytest.raises(ConfigError, match=r"data\.eval_sets\.gsm8k\.num_prompts must be >= 1"):
        apply_overrides(cfg, ["data.eval_sets.gsm8k.num_prompts=0"])
    with pytest.raises(ValueError, match=r"data\.eval_sets needs data\.path"):
        Config(data=DataConfig(eval_sets={"g": EvalSetConfig(path="g.jsonl")}))


def test_load_eval_sets_each_with_its_own_fields(tmp_path):
    from cispo.config.train import EvalSetConfig
    from cispo.data.prompts import load_eval_sets

    write_jsonl(tmp_path / "g.jsonl", [{"question": f"g{i}", "answer": str(i)} for i in range(5)])
    write_jsonl(tmp_path / "m" / "0.jsonl", [{"problem": "m0", "solution": "x", "level": 3}])
    cfg = file_data(eval_sets={
        "gsm8k": EvalSetConfig(path=str(tmp_path / "g.jsonl"), prompt_field="question", num_prompts=2),
        "math": EvalSetConfig(path=str(tmp_path / "m"), prompt_field="problem", answer_field="solution",
                              extra_fields=["level"])})
    assert load_eval_sets(cfg) == {"gsm8k": [{"prompt": "g0", "answer": "0"}, {"prompt": "g1", "answer": "1"}],
                                   "math": [{"prompt": "m0", "answer": "x", "level": 3}]}
    assert load_eval_sets(file_data()) == {}
    bad = file_data(eval_sets={"g": EvalSetConfig(path=str(tmp_path / "g.jsonl"), prompt_field="q")})
    with pytest.raises(DataError, match=r"g\.jsonl: line 1: field 'q': missing prompt field"):
        load_eval_sets(bad)


def test_evaluate_sets_names_metrics_per_set(monkeypatch):
    import cispo.training.evaluation as evaluation

    def fake_evaluate(policy, samples, *a, **kw):
        return {"eval/accuracy": float(len(samples)), "eval/accuracy_pass_at_4": 1.0}

    monkeypatch.setattr(evaluation, "evaluate", fake_evaluate)
    settings = evaluation.Evaluation(None, None, 8, seed=0)
    out = evaluation.evaluate_sets(None, {"gsm8k": [{}] * 3, "math500": [{}]}, settings)
    assert out == {"eval/gsm8k/accuracy": 3.0, "eval/gsm8k/accuracy_pass_at_4": 1.0,
                   "eval/math500/accuracy": 1.0, "eval/math500/accuracy_pass_at_4": 1.0}
    assert evaluation.evaluate_sets(None, {}, settings) == {}
