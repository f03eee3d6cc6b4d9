"""The start-up cache (`runtime.startup_cache`): what a run measured before its first step is read back for the same
config on the same machine, and measured again when anything that changes a device's seconds changes, or when
asked to."""

from dovetail.config.load import load_config
from dovetail.runtime.startup_cache import cached, key_of


def tree(*overrides: str) -> dict:
    return load_config(None, ["kind=lm", "task=sort", *overrides]).model_dump(mode="json")


def test_a_config_s_figures_are_measured_once_and_again_only_when_they_could_differ(tmp_path, monkeypatch):
    monkeypatch.setenv("DOVETAIL_CACHE", str(tmp_path))
    measured = []

    def measure():
        measured.append(1)
        return {"prefill": float(len(measured))}

    assert cached("profile", [tree()], measure) == {"prefill": 1.0}
    assert cached("profile", [tree("train.steps=7", "eval.every=3", "policy=streamrl")], measure) == {"prefill": 1.0}
    assert cached("profile", [tree("algo.group_size=4")], measure) == {"prefill": 2.0}  # other work: measured
    assert cached("profile", [tree()], measure, reprofile=True) == {"prefill": 3.0}  # --reprofile
    assert cached("profile", [tree()], measure) == {"prefill": 3.0}  # what --reprofile measured is kept
    assert cached("interference", [tree()], measure) == {"prefill": 4.0}  # another measurement, another entry
    assert len(measured) == 4


def test_the_key_holds_the_machine_s_kernel_setting(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    default = key_of("profile", [tree()])
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert key_of("profile", [tree()]) != default


def test_a_damaged_entry_is_measured_again_and_off_measures_every_time(tmp_path, monkeypatch):
    monkeypatch.setenv("DOVETAIL_CACHE", str(tmp_path))
    cached("profile", [tree()], lambda: {"prefill": 1.0})
    (entry,) = tmp_path.iterdir()
    entry.write_text("{not json")
    assert cached("profile", [tree()], lambda: {"prefill": 2.0}) == {"prefill": 2.0}
    monkeypatch.setenv("DOVETAIL_CACHE", "off")
    assert cached("profile", [tree()], lambda: {"prefill": 3.0}) == {"prefill": 3.0}
