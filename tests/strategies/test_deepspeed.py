"""DeepSpeedStrategy on CPU with gloo, ZeRO stages 1, 2 and 3: real engines, real
checkpoints. Per stage, one run of tests/scripts/shard_deepspeed.py (two processes
started by ember's own launcher) does all checks; the tests read its results.
Config resolution is tested in-process (it needs no process group)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from ember.errors import MisconfigurationError
from ember.precision import Precision
from helpers import SCRIPTS, clean_env, quiet_env

HAVE_DS = importlib.util.find_spec("deepspeed") is not None
SCRIPT = str(SCRIPTS / "shard_deepspeed.py")


@pytest.fixture(scope="module")
def all_stages(ds_ops, tmp_path_factory):
    """One two-process launch runs the checks of ZeRO stages 1, 2 and 3, then those of
    asynchronous saves (each process pays DeepSpeed's start-up once)."""
    out = str(tmp_path_factory.mktemp("zero"))
    r = subprocess.run([sys.executable, SCRIPT, out, "1", "2", "3", "async"], env=quiet_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"the ZeRO checks failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return out


@pytest.fixture(params=[1, 2, 3], ids=lambda s: f"zero{s}")
def results(request, all_stages):
    stage = request.param

    def get(name, rank=0):
        with open(os.path.join(all_stages, f"zero{stage}", f"{name}.rank{rank}.json")) as f:
            return json.load(f)
    get.stage = stage
    return get


multiproc = [pytest.mark.multiproc, pytest.mark.timeout(900),
             pytest.mark.skipif(not HAVE_DS, reason="deepspeed is not installed")]


class TestZeRO:
    pytestmark = multiproc

    def test_training_matches_single_process_reference(self, results):
        r = results("reference")
        assert r["world"] == 2 and r["engine"] == "DeepSpeedEngine"
        assert r["max_diff"] < 1e-5                  # accumulation 2, clipping 0.5, per-step StepLR
        assert r["val_loss"] == pytest.approx(r["val_expected"], rel=1e-5)    # validation after training
        assert r["lr"] == pytest.approx(0.05 * 0.7 ** 4)   # the scheduler stepped once per optimizer step
        assert r["config"] == {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                               "train_batch_size": 16, "gradient_clipping": 0.5,
                               "managed_gradient_accumulation": False}
        env = r["env"]                               # ember's own launcher exported them for DeepSpeed
        assert env["RANK"] == "0" and env["LOCAL_RANK"] == "0" and env["WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] and env["MASTER_PORT"]

    def test_commit_checks_every_ranks_files(self, results):
        for rank in (0, 1):
            r = results("shard_commit", rank)
            assert r["committed"] is False, r
            assert r["error"] is not None and "not committed" in r["error"], r
        name = results("shard_commit", 1)["dropped"][0]
        assert name.startswith("zero_pp_rank_1_")
        for rank in (0, 1):
            assert f"rank 1's file {name} is missing" in results("shard_commit", rank)["error"]
        listed = results("shard_commit")["listed"]
        assert "trainer_state.pt" in listed
        for r in (0, 1):                           # each rank's ZeRO partition, listed with its bytes
            assert f"model/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" in listed, listed
            if results.stage == 3:
                assert f"model/zero_pp_rank_{r}_mp_rank_00_model_states.pt" in listed, listed
        if results.stage != 3:
            assert "model/mp_rank_00_model_states.pt" in listed, listed

    def test_no_clipping_unless_asked(self, results):
        r = results("noclip")
        assert r["max_diff"] < 1e-5
        assert r["clip_1_would_differ_by"] > 1e-2    # DeepSpeed's default clipping (1.0) would have shown

    def test_resume_is_bit_identical(self, results):
        r = results("resume")
        assert r["bit_identical"] and r["global_step"] == 6
        assert r["gradient_clipping"] == 0.0
        assert {"meta.json", "model", "trainer_state.pt"} <= set(r["files"])
        assert r["leftover_tmp"] == []

    def test_validate_from_checkpoint_without_fit(self, results):
        r = results("validate")
        assert r["val_loss"] == pytest.approx(r["expected"], rel=1e-5)
        assert r["load_from_checkpoint_equal"] and r["load_from_checkpoint_lr"] == 0.5   # Net.load_from_checkpoint

    def test_full_weights_load_into_trained_engine(self, results):
        r = results("load_weights")
        assert r["val_loss"] == pytest.approx(r["expected"], rel=1e-5)
        assert r["master_equal"]                     # the optimizer's fp32 copy was replaced too

    def test_full_export_loads_into_plain_module(self, results):
        r = results("export")
        assert r["files"] == ["model.safetensors"]
        assert r["max_out_diff"] < 1e-6

    def test_partitioned_memory(self, results):
        for rank in (0, 1):
            r = results("memory", rank)
            full = r["full_param_bytes"]
            # fp32 master copy + AdamW's two states, partitioned over 2 ranks at every stage
            assert r["optim_bytes"] == pytest.approx(3 * full / 2, rel=0.05)
            if results.stage == 3:
                assert r["param_bytes"] == pytest.approx(full / 2, rel=0.05)
            else:
                assert r["param_bytes"] == full

    def test_bf16_mixed_trains(self, results):
        r = results("bf16")
        assert r["bf16"] and r["finite"]
        assert r["last"] < 0.8 * r["first"]

    def test_cpu_offload(self, results):
        if results.stage == 1:
            pytest.skip("offload needs ZeRO stage 2 or 3")
        r = results("offload")
        assert r["max_diff"] < 1e-5
        assert r["offload_optimizer"] == "cpu"
        assert r["offload_param"] == ("cpu" if results.stage == 3 else None)

    def test_zero3_configure_model_partitions_at_construction(self, results):
        if results.stage != 3:
            pytest.skip("deepspeed.zero.Init is used under ZeRO-3 only")
        r = results("zero_init")
        assert r["partitioned_at_build"] and not r["inp_partitioned_at_build"]   # __init__ layers: at setup
        assert 0.1 < r["init_std"] < 0.2                # nn.Linear(16, 16)'s init, gathered intact
        assert r["max_diff"] < 1e-5

    def test_accelerator_prepare_custom_loop(self, results):
        r = results("accelerator")
        assert r["stage"] == results.stage
        assert r["model"] == "DeepSpeedEngine" and r["unwrapped"] == "Net"
        assert r["max_diff"] < 1e-5


@pytest.mark.skipif(not HAVE_DS, reason="deepspeed is not installed")
@pytest.mark.timeout(900)
def test_prebuilt_ops_are_reused(ds_ops):
    r = subprocess.run([sys.executable, "-c", "from ember.strategies.deepspeed import prebuild_ops; "
                        "print(prebuild_ops())"], env=quiet_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "False"        # nothing compiled the second time
    assert "compiling DeepSpeed" not in r.stderr


@pytest.mark.skipif(not HAVE_DS, reason="deepspeed is not installed")
@pytest.mark.timeout(300)
def test_a_build_killed_mid_compile_does_not_hang_the_next(ds_ops):
    """A builder killed while compiling leaves torch's ``lock`` file in the build folder,
    and torch waits on such a file for ever (a test run once stalled 15 minutes so). The
    next ember build notices it (no ember builder holds the turn) and goes on."""
    import fcntl
    folder = subprocess.run([sys.executable, "-c", "import os; os.environ['DS_ACCELERATOR'] = 'cpu'\n"
                             "from deepspeed.accelerator import get_accelerator\n"
                             "from torch.utils.cpp_extension import _get_build_directory\n"
                             "b = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
                             "print(_get_build_directory(b.name, False))"],
                            env=quiet_env(DS_ACCELERATOR="cpu"), capture_output=True, text=True, timeout=120)
    assert folder.returncode == 0, folder.stderr[-3000:]
    folder = folder.stdout.strip().splitlines()[-1]
    stale = os.path.join(folder, "lock")
    with open(os.path.join(folder, "ember-build.lock"), "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)     # as a builder would hold it, then dies without removing "lock"
        with open(stale, "w"):
            pass
    r = subprocess.run([sys.executable, "-W", "always", "-c", "from ember.strategies.deepspeed import prebuild_ops; "
                        "print(prebuild_ops())"], env=clean_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "False"
    assert f"removing {stale}" in r.stderr
    assert not os.path.exists(stale)


# -- config resolution (in-process, no deepspeed import) ------------------------------------
def _strategy(**kw):
    from ember.strategies import DeepSpeedStrategy
    return DeepSpeedStrategy(**kw)


def test_auto_values_filled_from_trainer():
    s = _strategy(config={"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                          "gradient_clipping": "auto", "bf16": {"enabled": "auto"}})
    s.precision = Precision.from_string("bf16-mixed")
    s.configure_from_trainer(accumulate_grad_batches=3, gradient_clip_val=None, micro_batch_size=8)
    cfg = s.resolve_config()
    assert cfg["train_micro_batch_size_per_gpu"] == 8 and cfg["gradient_accumulation_steps"] == 3
    assert cfg["train_batch_size"] == 8 * 3 * s.world_size
    assert cfg["gradient_clipping"] == 0.0                    # set explicitly: DeepSpeed's default is 1.0
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["managed_gradient_accumulation"] is False
    assert cfg["zero_force_ds_cpu_optimizer"] is False


def test_config_conflicts_name_both_values(tmp_path):
    s = _strategy(config={"gradient_accumulation_steps": 4})
    s.configure_from_trainer(accumulate_grad_batches=2, micro_batch_size=4)
    with pytest.raises(MisconfigurationError, match=r"gradient_accumulation_steps=4.*accumulate_grad_batches=2"):
        s.resolve_config()
    s = _strategy(config={"gradient_clipping": 1.0})
    s.configure_from_trainer(gradient_clip_val=None)
    with pytest.raises(MisconfigurationError, match=r"gradient_clipping=1.0.*gradient_clip_val=0.0"):
        s.resolve_config()
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 16, "fp16": {"enabled": True}}))
    s = _strategy(config=str(path))
    s.configure_from_trainer(micro_batch_size=4)
    with pytest.raises(MisconfigurationError, match=r"train_micro_batch_size_per_gpu=16.*batch_size=4"):
        s.resolve_config()
    s = _strategy(config=str(path))
    with pytest.raises(MisconfigurationError, match=r"fp16.enabled=True.*precision='32-true'"):
        s.resolve_config()
    s = _strategy(config={"train_batch_size": 7})
    s.configure_from_trainer(accumulate_grad_batches=1, micro_batch_size=4)
    with pytest.raises(MisconfigurationError, match=r"train_batch_size=7"):
        s.resolve_config()


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(MisconfigurationError, match="stage=3 conflicts"):
        _strategy(stage=3, config={"zero_optimization": {"stage": 1}})
    with pytest.raises(MisconfigurationError, match="stage"):
        _strategy(stage=4)
    with pytest.raises(MisconfigurationError, match="offload_parameters=True needs ZeRO stage 3"):
        _strategy(stage=2, offload_parameters=True)
    with pytest.raises(MisconfigurationError, match="'optimizer' section"):
        _strategy(config={"optimizer": {"type": "Adam"}})
    with pytest.raises(MisconfigurationError, match="no such file"):
        _strategy(config=str(tmp_path / "missing.json"))
    with pytest.raises(MisconfigurationError, match="gradient_clip_algorithm='value'"):
        _strategy().configure_from_trainer(gradient_clip_val=1.0, gradient_clip_algorithm="value")
    s = _strategy()
    s.precision = Precision.from_string("64-true")
    with pytest.raises(MisconfigurationError, match="precision"):
        s.resolve_config()


def test_async_save_is_a_strategy_switch_not_a_zero_key():
    # before async_save was a named argument, it went into the zero_optimization section unnoticed
    assert _strategy(async_save=True).async_save is True
    for flag in (True, False):
        assert "async_save" not in (_strategy(async_save=flag).resolve_config().get("zero_optimization") or {})


@pytest.fixture(scope="module")
def async_results(all_stages):
    """tests/scripts/async_deepspeed.py's checks, run in the ZeRO launch after its stages."""
    def get(name, rank=0):
        with open(os.path.join(all_stages, "async", f"{name}.rank{rank}.json")) as f:
            return json.load(f)
    return get


class TestAsyncSave:
    """DeepSpeedStrategy(async_save=True), ZeRO stage 2, 2 processes (tests/scripts/async_deepspeed.py)."""
    pytestmark = multiproc

    def test_async_checkpoint_equals_sync_one(self, async_results):
        for rank in (0, 1):
            r = async_results("async_equal", rank)
            assert r["same_files"] and r["unequal"] == [], r
            assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in r["files"], r["files"]
            assert "mp_rank_00_model_states.pt" in r["files"], r["files"]
            assert r["final_equal"]
            assert r["committed"] == ["step=3", "step=6"]      # committed at the next save / teardown

    def test_async_resume_is_bit_identical(self, async_results):
        for rank in (0, 1):
            r = async_results("async_equal", rank)
            assert r["resumed_bit_identical"] and r["global_step"] == 6

    def test_async_save_snapshots_before_returning(self, async_results):
        for rank in (0, 1):
            r = async_results("async_snapshot", rank)
            assert r["written_at_return"] is False, r     # its writer was held back: save returned before writing
            assert r["changed_live"]                      # the parameters did change after the save returned
            assert r["fp32_equal"] and r["module_file_equal"], r

    def test_async_commit_checks_every_ranks_files(self, async_results):
        name = async_results("async_commit", 1)["dropped"][0]
        assert name.startswith("zero_pp_rank_1_")
        for rank in (0, 1):
            r = async_results("async_commit", rank)
            assert r["returned"] and r["committed"] is False, r
            assert r["error"].startswith("CheckpointError") and f"rank 1's file {name} is missing" in r["error"], r

    def test_async_save_dropped_when_training_fails(self, async_results):
        for rank in (0, 1):
            r = async_results("async_failed_run", rank)
            assert r["error"] == "failed at step 4"
            assert r["left"] == [], r               # step=3 neither committed nor left as step=3.ember-tmp
            assert len(r["warned"]) == 1 and "step=3" in r["warned"][0], r


    @pytest.mark.parametrize("case, failing", [("sync_rank1", 1), ("sync_rank0", 0), ("async_rank1", 1)])
    def test_a_write_failing_on_one_rank_fails_every_rank_at_once(self, async_results, case, failing):
        for rank in (0, 1):
            r = async_results(f"enospc_{case}", rank)
            assert r["error"] is not None and r["error"].startswith("CheckpointError"), r
            assert f"rank {failing}: OSError: [Errno 28] No space left on device" in r["error"], r
            assert r["seconds"] < 20, r        # the process-group timeout is 60 s: nobody waited for it
            assert r["committed"] is False and r["next_save_committed"] is True, r
        assert async_results(f"enospc_{case}", failing)["cause"] == "OSError"   # the real error under it


FP16_CHECK = """
import os
os.environ["DS_ACCELERATOR"] = "cpu"
from deepspeed.accelerator import get_accelerator
if get_accelerator().is_fp16_supported():
    print("SKIP")
else:
    from ember.errors import MisconfigurationError
    from ember.precision import Precision
    from ember.strategies import DeepSpeedStrategy
    s = DeepSpeedStrategy(accelerator="cpu")
    s.precision = Precision.from_string("16-mixed")
    try:
        s.setup_environment()
    except MisconfigurationError as e:
        print("ERROR", e)
"""


@pytest.mark.skipif(not HAVE_DS, reason="deepspeed is not installed")
def test_fp16_on_cpu_is_a_clear_error():
    # in a subprocess: importing deepspeed here would leave its state in the test process
    r = subprocess.run([sys.executable, "-c", FP16_CHECK], env=quiet_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    if r.stdout.strip() == "SKIP":
        pytest.skip("this CPU supports fp16 in DeepSpeed")
    assert "precision='16-mixed' under DeepSpeed needs fp16" in r.stdout
    assert "use 'bf16-mixed' or '32-true'" in r.stdout


def test_offload_and_launcher_environment(monkeypatch):
    from ember.strategies import DeepSpeedStrategy, build_strategy
    monkeypatch.setenv("EMBER_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("EMBER_DEEPSPEED_OFFLOAD_OPTIMIZER", "cpu")
    monkeypatch.setenv("EMBER_DEEPSPEED_OFFLOAD_PARAMS", "cpu")
    s = build_strategy("deepspeed", "cpu")
    assert isinstance(s, DeepSpeedStrategy) and s.owns_optimizer_step and s.name == "deepspeed"
    zero = s.resolve_config()["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    s = _strategy(stage=1, offload_optimizer=False, offload_parameters=False)
    zero = s.resolve_config()["zero_optimization"]
    assert zero["stage"] == 1 and "offload_optimizer" not in zero
