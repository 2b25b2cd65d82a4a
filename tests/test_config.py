"""The typed config: precedence, inheritance, and errors that name the key, the file and the fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from transformer_mt.config import (
    Config,
    ConfigError,
    config_from_dict,
    config_hash,
    load_config,
    parse_override,
    save_config,
    shipped_configs,
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _yaml(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_are_the_paper_base_model():
    cfg = load_config()
    assert (cfg.model.d_model, cfg.model.d_ff, cfg.model.heads, cfg.model.encoder_layers) == (512, 2048, 8, 6)
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2, cfg.train.adam_eps) == (0.9, 0.98, 1e-9)
    assert (cfg.train.warmup, cfg.train.label_smoothing, cfg.model.dropout) == (4000, 0.1, 0.1)
    assert (cfg.decode.beam_size, cfg.decode.len_penalty) == (4, 0.6)
    assert cfg.model.norm == "post" and cfg.model.positions == "sinusoidal"


def test_precedence_defaults_file_set(tmp_path):
    path = _yaml(tmp_path / "c.yaml", "train:\n  warmup: 100\n  seed: 5\n")
    cfg = load_config(path, ["train.seed=9"])
    assert cfg.train.warmup == 100  # file over default
    assert cfg.train.seed == 9  # --set over file
    assert cfg.train.max_tokens == 3125  # default untouched


def test_base_inheritance_and_override_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # base: is relative to the working directory, like every path in a config
    _yaml(tmp_path / "root.yaml", "model:\n  d_model: 256\n  heads: 4\ntrain:\n  warmup: 10\n")
    (tmp_path / "sub").mkdir()
    child = _yaml(tmp_path / "sub" / "child.yaml", "base: root.yaml\ntrain:\n  warmup: 20\n")
    cfg = load_config("sub/child.yaml")
    assert cfg.model.d_model == 256 and cfg.model.heads == 4 and cfg.train.warmup == 20
    assert load_config(child) == cfg  # the same from anywhere below the working directory


def test_base_relative_to_the_config_file_is_the_old_rule_and_says_the_new_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    _yaml(tmp_path / "sub" / "root.yaml", "train:\n  warmup: 10\n")
    _yaml(tmp_path / "sub" / "child.yaml", "base: root.yaml\n")
    with pytest.raises(ConfigError, match=r"relative to the directory tmt runs in.*write base: sub/root\.yaml$"):
        load_config("sub/child.yaml")


def test_shipped_configs_are_named_with_tmt_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("tmt:base.yaml") == load_config("tmt:base") == load_config(CONFIGS / "base.yaml")
    child = _yaml(tmp_path / "mine.yaml", "base: tmt:multi30k.yaml\nmodel:\n  d_model: 128\n")
    cfg = load_config(child)
    assert (cfg.model.d_model, cfg.model.d_ff, cfg.bpe.vocab_size) == (128, 1024, 8000)
    assert {"base.yaml", "big.yaml", "toy.yaml", "table3/a_h1.yaml"} <= set(shipped_configs())
    with pytest.raises(ConfigError, match=r"tmt:bse\.yaml: tmt ships no such config; shipped: tmt:base\.yaml"):
        load_config("tmt:bse.yaml")
    with pytest.raises(ConfigError, match="no such config"):
        load_config("tmt:../../cli.py")  # a name, not a way out of the package
    _yaml(tmp_path / "old.yaml", "base: base.yaml\n")
    with pytest.raises(ConfigError, match=r"old\.yaml: base: base\.yaml not found.*write base: tmt:base\.yaml"):
        load_config("old.yaml")


def test_every_shipped_config_loads_and_inherits_by_tmt_name():
    for name in shipped_configs():
        text = (CONFIGS / name).read_text(encoding="utf-8")
        assert "\nbase: " not in text or "\nbase: tmt:" in text, name  # shipped configs work without a checkout
        load_config(f"tmt:{name}")


def test_base_loop_is_an_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _yaml(tmp_path / "a.yaml", "base: b.yaml\n")
    _yaml(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(tmp_path / "a.yaml")


def test_unknown_key_names_file_and_nearest(tmp_path):
    path = _yaml(tmp_path / "c.yaml", "train:\n  warmpu: 100\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: unknown key 'train\.warmpu'; did you mean 'warmup'\?"):
        load_config(path)


def test_unknown_section_and_unknown_set_key():
    with pytest.raises(ConfigError, match="unknown section 'modle'; did you mean 'model'"):
        load_config(None, ["modle.d_model=3"])
    with pytest.raises(ConfigError, match=r"--set train\.max_tokenz=5: unknown key 'train\.max_tokenz'"):
        load_config(None, ["train.max_tokenz=5"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.warmup=abc", "key 'train.warmup': expected an integer"),
        ("train.warmup=1.5", "expected an integer"),
        ("model.share_embeddings=3", "expected true or false"),
        ("model.norm=middle", "'middle' is not one of 'post', 'pre'"),
        ("train.lr_scale=fast", "expected a number"),
        ("decode.quantize=int4", "key 'decode.quantize': 'int4' is not one of 'none', 'int8'"),
    ],
)
def test_wrong_types_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config(None, [override])


def test_wrong_type_in_file_names_the_file(tmp_path):
    path = _yaml(tmp_path / "bad.yaml", "data:\n  max_len: lots\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: key 'data\.max_len'"):
        load_config(path)


def test_set_values_parse_as_yaml():
    assert parse_override("train.max_updates=2000") == ("train", "max_updates", 2000)
    assert parse_override("model.share_embeddings=false") == ("model", "share_embeddings", False)
    assert parse_override("data.test=") == ("data", "test", "")
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("warmup=3")
    with pytest.raises(ConfigError, match=r"did you mean --set train\.max_minutes=3\?"):
        parse_override("max_minutes=3")
    with pytest.raises(ConfigError, match="for example --set train.max_updates"):
        parse_override("nothing_like_it=3")


def test_cross_key_validation():
    with pytest.raises(ConfigError, match=r"divisible by model\.heads \(3\); try heads="):
        load_config(None, ["model.heads=3"])
    with pytest.raises(ConfigError, match=r"train\.save_dir is empty"):
        load_config(None, ["train.save_dir="])
    with pytest.raises(ConfigError, match=r"train\.weight_decay must be 0"):
        load_config(None, ["train.weight_decay=-1"])
    with pytest.raises(ConfigError, match=r"train\.max_updates 100000000000000000000000000000 is past any run"):
        load_config(None, ["train.max_updates=100000000000000000000000000000"])
    with pytest.raises(ConfigError, match=r"model\.heads must be positive, got 0"):  # not a ZeroDivisionError
        load_config(None, ["model.heads=0"])
    with pytest.raises(ConfigError, match=r"decode\.len_penalty must be a number"):
        load_config(None, ["decode.len_penalty=.nan"])
    with pytest.raises(ConfigError, match="would never stop"):
        load_config(None, ["train.max_updates=0"])
    with pytest.raises(ConfigError, match=r"model\.dropout must be in \[0, 1\)"):
        load_config(None, ["model.dropout=1.0"])
    with pytest.raises(ConfigError, match=r"train\.pad_to_multiple must be 0 \(off\) or a multiple"):
        load_config(None, ["train.pad_to_multiple=-8"])


def test_validation_bleu_best_metric_and_patience_keys():
    tc = load_config().train
    assert (tc.valid_bleu_sentences, tc.valid_bleu_beam, tc.best_metric, tc.patience) == (0, 1, "loss", 0)  # off
    cfg = load_config(None, ["train.valid_bleu_sentences=-1", "train.best_metric=bleu", "train.patience=3"])
    assert (cfg.train.valid_bleu_sentences, cfg.train.best_metric, cfg.train.patience) == (-1, "bleu", 3)
    with pytest.raises(ConfigError, match=r"best_metric=bleu needs a validation BLEU: set train\.valid_bleu_sentences"):
        load_config(None, ["train.best_metric=bleu"])
    with pytest.raises(ConfigError, match=r"'accuracy' is not one of 'loss', 'bleu'"):
        load_config(None, ["train.best_metric=accuracy"])
    with pytest.raises(ConfigError, match=r"valid_bleu_sentences must be -1 \(all\), 0 \(off\)"):
        load_config(None, ["train.valid_bleu_sentences=-2"])
    with pytest.raises(ConfigError, match=r"valid_bleu_beam must be at least 1"):
        load_config(None, ["train.valid_bleu_sentences=10", "train.valid_bleu_beam=0"])
    with pytest.raises(ConfigError, match=r"patience must be 0 \(off\)"):
        load_config(None, ["train.patience=-1"])
    with pytest.raises(ConfigError, match=r"patience=2 counts validations, but train\.validate_every=0"):
        load_config(None, ["train.patience=2", "train.validate_every=0"])


@pytest.mark.parametrize("key", ["train.warmup", "train.log_every", "train.keep_last", "train.average_last"])
def test_counts_that_must_be_positive(key):
    with pytest.raises(ConfigError, match=rf"{key} must be positive, got 0"):
        load_config(None, [f"{key}=0"])


@pytest.mark.parametrize("key", ["data.train", "data.valid"])
def test_train_and_valid_prefixes_are_required_but_not_test(key):
    with pytest.raises(ConfigError, match=rf"{key} is empty; it must name the .* files' prefix"):
        load_config(None, [f"{key}="])
    assert load_config(None, ["data.test="]).data.test == ""


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_yaml(tmp_path / "x.yaml", "train: [unclosed\n"))


def test_a_missing_base_names_the_file_whose_base_line_is_wrong(tmp_path):
    child = _yaml(tmp_path / "child.yaml", "base: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"child\.yaml: base: missing\.yaml not found"):
        load_config(child)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr_scale=-1", r"train\.lr_scale must be a number, 0 or more"),  # trained with a negative lr before
        ("train.lr_scale=.nan", r"train\.lr_scale must be a number, 0 or more.*got nan"),  # caught after 10 updates
        ("train.lr_scale=.inf", r"train\.lr_scale must be a number, 0 or more"),
        ("train.adam_beta1=2.0", r"train\.adam_beta1 must be in \[0, 1\)"),
        ("train.adam_beta2=1.0", r"train\.adam_beta2 must be in \[0, 1\)"),
        ("train.adam_eps=0", r"train\.adam_eps must be a small positive number"),
        ("train.lr=.nan", r"train\.lr must be a number"),
        ("train.seed=-1", r"train\.seed must be an integer from 0 to 4294967295, got -1"),
        ("train.seed=12345678901234567890", r"train\.seed must be an integer from 0 to 4294967295"),
        ("bpe.seed=-1", r"bpe\.seed must be an integer"),
        ("decode.max_len_a=-0.5", r"decode\.max_len_a must be 0 or more"),
        ("decode.max_len_b=-1", r"decode\.max_len_b must be 0 or more"),
        ("decode.no_repeat_ngram=-2", r"decode\.no_repeat_ngram must be 0 \(off, the paper\) or an n-gram size"),
        ("model.max_positions=100000000", r"model\.max_positions must be at most 65536, got 100000000"),  # 51 GB
        ("decode.beam_size=1000000", r"decode\.beam_size must be at most 1000"),
        ("bpe.vocab_size=10000000000", r"bpe\.vocab_size must be at most"),
        ("train.num_threads=-3", r"train\.num_threads must be 0 \(the CPUs the process may use\) or more, got -3"),
        ("train.validate_every=-1", r"train\.validate_every must be 0 \(validate only at the end\) or a number"),
        ("train.save_every_updates=-2", r"train\.save_every_updates must be 0 \(off\) or a number of updates"),
    ],
)
def test_values_that_would_train_or_decode_wrongly_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_round_trip_through_dict_and_yaml(tmp_path):
    cfg = load_config(None, ["model.d_model=256", "model.heads=4", "decode.beam_size=6"])
    assert config_from_dict(cfg.to_dict()) == cfg
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg


def test_config_hash_is_stable_and_sensitive():
    a, b = Config(), Config()
    assert config_hash(a.bpe) == config_hash(b.bpe)
    assert config_hash(a.bpe) != config_hash(load_config(None, ["bpe.vocab_size=8000"]).bpe)


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_load(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.model.d_model % cfg.model.heads == 0


def test_multi30k_config_matches_the_benchmark_recipe():
    cfg = load_config(CONFIGS / "multi30k.yaml")
    assert cfg.data.train == "../shared/data/multi30k/train" and cfg.data.dir == "prepared/multi30k"
    assert cfg.bpe.vocab_size == 8000
    m = cfg.model
    assert (m.d_model, m.encoder_layers, m.decoder_layers, m.heads, m.d_ff) == (256, 3, 3, 4, 1024)
    t = cfg.train
    assert (t.max_tokens, t.update_freq, t.schedule, t.lr, t.warmup_fraction) == (4096, 1, "linear", 1e-3, 0.1)
    assert t.min_warmup == 80
    assert (t.max_minutes, t.snapshot_span, t.average_last, t.decay_fraction) == (20, 0.1, 5, 0.3)
    assert t.save_dir == "runs/multi30k"


def test_multi30k_hour_config_changes_only_the_model_its_rate_and_the_length_penalty():
    """configs/multi30k_hour.yaml is multi30k.yaml with a model, dropout, peak rate and length penalty for 60
    minutes: the data, vocabulary, batches, schedule shape, snapshots and the rest of the search stay the race's."""
    from transformer_mt.train.schedule import Schedule

    hour, minutes = load_config(CONFIGS / "multi30k_hour.yaml"), load_config(CONFIGS / "multi30k.yaml")
    assert (hour.data, hour.bpe) == (minutes.data, minutes.bpe)
    assert dataclasses.replace(hour.decode, len_penalty=0.6) == minutes.decode and hour.decode.len_penalty == 1.5
    m = hour.model
    assert (m.d_model, m.d_ff, m.heads, m.encoder_layers, m.decoder_layers) == (128, 256, 4, 4, 4)
    assert (m.dropout, m.attention_dropout, m.activation_dropout, m.norm, m.init) == (0.2, 0.1, 0.1, "post", "fairseq")
    t = hour.train
    assert (t.max_minutes, t.lr, t.save_dir) == (60, 3.5e-3, "runs/multi30k_hour")
    assert dataclasses.replace(t, max_minutes=20, lr=1e-3, save_dir="runs/multi30k") == minutes.train
    sched = Schedule.from_config(t, m.d_model)
    assert sched.lr(1000, 0.05) < sched.lr(1000, 0.1) == pytest.approx(3.5e-3)  # warmup over the first 10% of the hour
    assert sched.lr(1000, 0.7) == pytest.approx(3.5e-3) and sched.lr(1000, 0.85) == pytest.approx(3.5e-3 / 2)


def test_fairseq_replay_config_is_the_published_recipe():
    """configs/multi30k_fairseq.yaml: raw data, peak 1e-3 after 80 updates, inverse sqrt, and fairseq-generate's
    length penalty, stopping rule and length limit."""
    from transformer_mt.train.schedule import Schedule

    cfg = load_config(CONFIGS / "multi30k_fairseq.yaml")
    assert cfg.data.max_ratio >= 1000 and cfg.data.max_len >= 1000 and cfg.bpe.vocab_size == 8000
    m, t = cfg.model, cfg.train
    assert (m.d_model, m.encoder_layers, m.heads, m.d_ff, m.dropout, m.init) == (256, 3, 4, 1024, 0.1, "fairseq")
    sched = Schedule.from_config(t, m.d_model)
    assert sched.lr(80, 0.0) == pytest.approx(1e-3, rel=1e-3)
    assert sched.lr(320, 0.0) == pytest.approx(1e-3 * (80 / 320) ** 0.5, rel=1e-3)
    assert (t.max_tokens, t.save_every_updates, t.max_minutes, t.average_last) == (4096, 50, 20, 5)
    d = cfg.decode
    assert (d.beam_size, d.len_penalty_form, d.stopping, d.max_len_a, d.max_len_b) == (
        4,
        "fairseq",
        "k_finished",
        0,
        200,
    )


@pytest.mark.parametrize("name", ["base", "big"])
def test_paper_configs_keep_every_deviation_off(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    m, t, d = cfg.model, cfg.train, cfg.decode
    assert (m.norm, m.positions, m.attention_dropout, m.activation_dropout, m.share_embeddings) == (
        "post", "sinusoidal", 0.0, 0.0, True,
    )  # fmt: skip
    assert m.encoder_no_residual_layer == 0
    assert m.d_k == 0  # not a deviation: d_k = d_model/h is the paper's own choice, kept explicit (row B changes it)
    assert (t.schedule, t.lr, t.lr_scale, t.warmup, t.warmup_fraction, t.decay_fraction, t.snapshot_span) == (
        "inverse_sqrt", 0.0, 1.0, 4000, 0.0, 0.0, 0.0,
    )  # fmt: skip
    assert t.min_warmup == 0
    assert t.init_from == ""  # a new run starts from random weights, as the paper's did
    assert cfg.bpe.model == ""  # the BPE model is learned from the training data, as the paper's was
    assert (t.clip_norm, t.weight_decay, t.label_smoothing) == (0.0, 0.0, 0.1)
    assert (t.compile, t.pad_to_multiple) == (False, 0)  # speed keys, named and off: the paper's own shapes
    assert (d.beam_size, d.len_penalty, d.len_penalty_form, d.max_len_b, d.quantize) == (4, 0.6, "gnmt", 50, "none")
    assert d.no_repeat_ngram == 0  # the paper's search may repeat itself


def _bomb(levels: int) -> str:
    """A YAML list of 10^levels values in a few hundred bytes: each anchor holds ten aliases of the one before."""
    names = "abcdefgh"[: levels + 1]
    nested = [f"&{n} [{', '.join([f'*{p}'] * 10)}]" for p, n in zip(names, names[1:], strict=False)]
    return "[" + ", ".join([f"&a [{', '.join(['lol'] * 10)}]", *nested]) + "]"


_BOMB = _bomb(6)


def test_a_yaml_alias_bomb_is_refused_in_one_short_line(tmp_path):
    with pytest.raises(ConfigError, match=r"bomb\.yaml: the values expand to more than 100000") as err:
        load_config(_yaml(tmp_path / "bomb.yaml", f"model:\n  heads: {_BOMB}\n"))
    assert len(str(err.value)) < 300
    with pytest.raises(ConfigError, match=r"--set model\.heads: the values expand"):
        load_config(None, [f"model.heads={_BOMB}"])


def test_a_value_in_a_message_is_cut_to_a_line(tmp_path):
    """A small bomb (below the bound) or a long string for a number: the message shows the start of it only."""
    small = _bomb(3)
    with pytest.raises(ConfigError, match=r"key 'model\.heads': expected an integer, got \[\['lol'") as err:
        load_config(_yaml(tmp_path / "small.yaml", f"model:\n  heads: {small}\n"))
    assert len(str(err.value)) < 200
    with pytest.raises(ConfigError, match=r"expected an integer, got 'xxx") as err:
        load_config(None, ["model.heads=" + "x" * 100_000])
    assert len(str(err.value)) < 300
    with pytest.raises(ConfigError, match=r"nested too deeply"):
        load_config(_yaml(tmp_path / "deep.yaml", "model:\n  heads: " + "[" * 5000 + "]" * 5000 + "\n"))


def test_a_file_that_is_not_a_config_is_named_for_what_it_is(tmp_path: Path) -> None:
    """A checkpoint, a binary or a Latin-1 file given where a config goes (or as its base:) is one ConfigError
    naming the file and what it looks like, never a UnicodeDecodeError."""
    import torch

    checkpoint = tmp_path / "average.pt"
    torch.save({"model": {}}, checkpoint)
    with pytest.raises(ConfigError, match=r"average\.pt: a tmt checkpoint .*not a config: pass a checkpoint with -c"):
        load_config(checkpoint)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("train:\n  max_updates: 3  # café\n".encode("latin-1"))
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {latin}\n", encoding="utf-8")
    for path in (latin, child):
        with pytest.raises(ConfigError, match=r"latin\.yaml: not UTF-8 text \(byte 30 is b'\\xe9'\), so not a config"):
            load_config(path)


def test_a_number_of_thousands_of_digits_is_a_config_error(tmp_path: Path) -> None:
    """Python refuses to read an int of more than 4300 digits; the config says which file or --set holds it."""
    huge = "9" * 5000
    path = tmp_path / "huge.yaml"
    path.write_text(f"train:\n  max_updates: {huge}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"huge\.yaml: a number of thousands of digits"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"--set train\.max_updates: a number of thousands of digits"):
        load_config(None, [f"train.max_updates={huge}"])
    path.write_text("train:\n  max_updates: 2024-13-45\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"huge\.yaml: a value that cannot be read \(month must be in 1\.\.12\)"):
        load_config(path)
