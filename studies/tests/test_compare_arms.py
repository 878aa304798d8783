"""Arms of a comparison, the K-sweep fairness options and the per-run statistics."""

import math

import pytest

from cispo.config.train import ConfigError, apply_overrides
from cispo.objective.loss import PRESETS, preset
from studies.arms import BUILTIN_ARMS, ArmConfig, resolve_arms
from studies.compare import CompareConfig, SweepConfig, base_config, run_configs, warmup_updates
from studies.stats import censored_steps, collapsed, fieller_ratio, holm, paired_t, wilson


def test_builtin_arms_are_the_presets_and_the_ablations():
    assert set(PRESETS) <= set(BUILTIN_ARMS)
    ablations = {"cispo_seqmean", "cispo_cap0.2", "cispo_cap1", "cispo_cap2", "cispo_cap4", "cispo_cap8"}
    assert ablations <= set(BUILTIN_ARMS)
    seqmean = BUILTIN_ARMS["cispo_seqmean"]
    seqmean_preset = preset("cispo", aggregation="seq-mean-token-mean")
    assert preset(seqmean.objective, **seqmean.objective_overrides) == seqmean_preset
    assert preset("cispo", **BUILTIN_ARMS["cispo_cap0.2"].objective_overrides).eps_high_is == 0.2
    assert preset("cispo", **BUILTIN_ARMS["cispo_cap4"].objective_overrides) == PRESETS["cispo"]


def test_runs_are_named_and_configured_by_arm():
    cfg = CompareConfig(arms=["dapo", "cispo_cap8", "mine"], seeds=[0, 1], out_dir="/tmp/x",
                        arm_defs={"mine": ArmConfig(objective="gspo", objective_overrides={"eps_high": 1e-3},
                                                    train=["rollout.dynamic_sampling=false"])})
    ordered = run_configs(cfg)
    # seed by seed, so a comparison stopped early holds whole seeds (every arm paired)
    assert [(r.arm, r.config.seed) for r in ordered] == [(a, s) for s in (0, 1) for a in ("dapo", "cispo_cap8", "mine")]
    runs = {(r.arm, r.config.seed): r for r in ordered}
    assert len(runs) == 6
    r = runs[("cispo_cap8", 1)]
    assert r.config.run_name == "cispo_cap8__addition__K16__seed1" and r.config.out_dir == "/tmp/x"
    assert r.config.algo.objective.name == "cispo" and r.config.algo.objective.overrides() == {"eps_high_is": 8.0}
    mine = runs[("mine", 0)].config
    assert mine.algo.objective.name == "gspo" and mine.algo.objective.overrides() == {"eps_high": 1e-3}
    assert mine.rollout.dynamic_sampling is False and runs[("dapo", 0)].config.rollout.dynamic_sampling is True
    assert runs[("mine", 0)].meta()["spec"] == "gspo(eps_high=0.001) + rollout.dynamic_sampling=false"
    # the old preset names keep their old run names (a finished 2026-11-30 comparison resumes)
    assert runs[("dapo", 0)].config.run_name == "dapo__addition__K16__seed0"


def test_arms_from_key_value_overrides_and_their_errors():
    cfg = apply_overrides(CompareConfig(), ["arms=[grpo,cap3]", "arm_defs.cap3.objective=cispo",
                                            "arm_defs.cap3.objective_overrides.eps_high_is=3"])
    assert resolve_arms(cfg.arms, cfg.arm_defs)["cap3"].objective_overrides == {"eps_high_is": 3}
    with pytest.raises(ConfigError, match="unknown arm 'cispo_cap3'"):
        apply_overrides(CompareConfig(), ["arms=[cispo_cap3]"])
    with pytest.raises(ConfigError, match="ObjectiveConfig has no field 'eps_hi'"):
        apply_overrides(CompareConfig(), ["arm_defs.x.objective_overrides.eps_hi=3"])
    with pytest.raises(ConfigError, match="listed twice"):
        apply_overrides(CompareConfig(), ["arms=[dapo,dapo]"])
    with pytest.raises(ConfigError, match="not a usable arm name"):
        apply_overrides(CompareConfig(), ["arms=[a__b]", "arm_defs.a__b.objective=cispo"])
    with pytest.raises(ConfigError, match="tune_seeds must be disjoint from seeds"):
        apply_overrides(CompareConfig(), ["seeds=[0,1]", "tune_seeds=[1]"])


def test_fairness_constant_minibatch_and_warmup_fraction():
    cfg = SweepConfig(minibatch_prompts=2, warmup_fraction=0.1, train=["steps=16"])
    for k, warm in ((1, 2), (2, 4), (4, 7), (16, 16), (32, 16)):
        c = base_config(cfg, k=k)
        assert c.rollout.prompts_per_step == 2 * k  # mini-batch: 2 prompts x G at every K
        assert c.rollout.prompts_per_step * c.rollout.group_size // k == 2 * c.rollout.group_size
        assert c.optim.warmup_updates == warm == min(16, math.ceil(0.1 * 16 * k))
    plain = base_config(SweepConfig(), k=1)  # off: the old fixed settings
    assert plain.rollout.prompts_per_step == 16 and plain.optim.warmup_updates == 16
    assert warmup_updates(16, 0.1, 20) == 2 and warmup_updates(16, 0.5, 1) == 1 and warmup_updates(4, 1.0, 100) == 4
    with pytest.raises(ValueError, match="warmup_fraction"):
        CompareConfig(warmup_fraction=0.0)


def test_collapse_flag_by_definition():
    assert collapsed({0: 0.0, 2: 0.6, 4: 0.8, 6: 0.3, 8: 0.35}) is True  # below 0.4 after the peak, to the end
    assert collapsed({0: 0.0, 2: 0.8, 4: 0.3, 6: 0.5}) is False  # dipped, recovered above half the peak
    assert collapsed({0: 0.0, 2: 0.3, 4: 0.8}) is False  # peak at the end
    assert collapsed({0: 0.0, 2: 0.8, 4: 0.4}) is False  # exactly half: not below
    assert collapsed({0: 0.0, 2: 0.09, 4: 0.01}) is None  # peak 0.09 < floor 0.1: never learned
    assert collapsed({0: 0.0, 2: 0.1, 4: 0.04}) is True  # peak exactly at the floor counts as learned
    assert collapsed({0: 0.5, 2: 0.2, 4: 0.1}) is True  # the peak may be the base model's (step 0)
    assert collapsed({0: 0.0, 2: 0.3, 4: 0.1}, floor=0.31) is None
    assert collapsed({0: 0.2}) is None


def test_intervals_by_hand():
    p = paired_t([1.0, 2.0, 3.0])
    assert p.mean == 2.0 and p.half == pytest.approx(4.302653 * 1.0 / math.sqrt(3), rel=1e-6)
    t = 2 / (1 / math.sqrt(3))  # df 2: P(T > t) = (1 - t / sqrt(t² + 2)) / 2, two-sided twice that
    assert p.p == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-9)
    assert paired_t([0.0, 0.0]).p == 1.0 and paired_t([1.0, 1.0]).p == 0.0
    # Holm: sorted 0.01, 0.03, 0.04 -> 0.03, 0.06, 0.06 (monotone)
    assert holm([0.04, 0.01, 0.03]) == pytest.approx([0.06, 0.03, 0.06])
    assert holm([0.5, float("nan")])[0] == 0.5
    lo, hi = wilson(2, 8)  # by the formula: (p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)
    z, n, ph = 1.959964, 8, 0.25
    centre = (ph + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(ph * (1 - ph) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert (lo, hi) == pytest.approx((centre - half, centre + half), abs=1e-6)
    assert wilson(0, 0) == (0.0, 1.0)


def test_fieller_ratio_and_censoring():
    r, lo, hi = fieller_ratio([4.0, 4.0, 4.0], [8.0, 8.0, 8.0])  # no spread: the interval is the point
    assert (r, lo, hi) == pytest.approx((0.5, 0.5, 0.5))
    r, lo, hi = fieller_ratio([3.0, 5.0, 4.0, 6.0], [8.0, 9.0, 10.0, 11.0])
    assert r == pytest.approx(18 / 38) and lo < r < hi
    # the bounds solve (x̄ - R ȳ)² = t² Var(x̄ - R ȳ): the paired t statistic of num - R den is ± t
    for bound in (lo, hi):
        d = [a - bound * b for a, b in zip([3.0, 5.0, 4.0, 6.0], [8.0, 9.0, 10.0, 11.0])]
        assert abs(paired_t(d).mean) == pytest.approx(paired_t(d).half, rel=1e-6)
    assert fieller_ratio([1.0, 2.0], [-1.0, 1.0])[1:] == (-math.inf, math.inf)  # denominator not away from 0
    assert censored_steps({0: 0.1, 2: 0.5, 4: 0.7}, 0.6) == (4.0, True)
    assert censored_steps({0: 0.1, 2: 0.5, 4: 0.55}, 0.6) == (6.0, False)  # last step + one interval


def test_arms_from_a_yaml_file_and_an_error_naming_its_line(tmp_path):
    from cispo.config.train import load_yaml

    good = tmp_path / "study.yaml"
    good.write_text("arms: [dapo, cap3]\narm_defs:\n  cap3:\n    objective: cispo\n    objective_overrides:\n"
                    "      eps_high_is: 3.0\n    train: [rollout.dynamic_sampling=false]\n")
    cfg = load_yaml(CompareConfig, good)
    [dapo, cap3] = run_configs(cfg)[:2]
    assert cap3.arm == "cap3" and cap3.config.algo.objective.overrides() == {"eps_high_is": 3.0}
    assert cap3.config.rollout.dynamic_sampling is False and dapo.config.rollout.dynamic_sampling is True
    bad = tmp_path / "bad.yaml"
    bad.write_text("arms: [cap3]\narm_defs:\n  cap3:\n    objective: cispo\n    objective_overrides:\n"
                   "      eps_hihg_is: 3.0\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: .*no field 'eps_hihg_is'"):
        load_yaml(CompareConfig, bad)


def test_the_old_keys_say_what_replaced_them(capsys):
    from studies.cli import main

    assert main(["compare", "algorithms=[grpo,cispo]"]) == 2
    assert "algorithms is now arms" in capsys.readouterr().err
    assert main(["sweep", "tune_seed=7"]) == 2
    assert "tune_seed is now tune_seeds" in capsys.readouterr().err
    assert main(["compare", "tuning_from=/nonexistent", "out_dir=/tmp/nothing_here"]) == 2
    assert "tuning_from: cannot read the chosen rates from /nonexistent/tuning.json" in capsys.readouterr().err
