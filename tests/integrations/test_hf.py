"""moga in Hugging Face's Trainer and in an Accelerate loop: train, save, resume, and get the same losses."""

import warnings

import pytest
import torch

from moga.integrations.hf import create_optimizer
from moga.optim import MOGA
from moga.optim.multipliers import PRESETS, base_lr
from tests.integrations.lm import CharBlocks, record_losses, tiny_gpt2

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install moga[hf])",
                                   exc_type=ImportError)
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install moga[hf])", exc_type=ImportError)

STEPS, SAVE_AT, BATCH, LR = 24, 12, 8, 0.02


def training_args(out, **kw):
    return transformers.TrainingArguments(**{
        "output_dir": str(out), "max_steps": STEPS, "per_device_train_batch_size": BATCH, "learning_rate": LR,
        "weight_decay": 0.1, "save_strategy": "steps", "save_steps": SAVE_AT, "logging_steps": 1, "report_to": [],
        "seed": 0, "use_cpu": True, "disable_tqdm": True, "dataloader_num_workers": 0, **kw})


def test_create_optimizer_reads_training_arguments(tmp_path):
    args = training_args(tmp_path, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)
    model = tiny_gpt2(65)
    opt = create_optimizer(model, args, name="moga", p=2.5)
    assert isinstance(opt, MOGA) and opt.plan["lm_head.weight"].role == "tied"
    for group in opt.param_groups:  # learning_rate is the base lr; MOGA's default preset scales the tables' (wpe)
        assert (group["lr"], group["betas"], group["eps"]) == \
            (LR * PRESETS["default"].lr_multipliers.get(group["role"], 1.0), (0.8, 0.95), 1e-6)
        assert group["nesterov"] == PRESETS["default"].nesterov  # MOGA's default momentum: args set no momentum
        assert base_lr(group) == LR
        assert group["weight_decay"] == (0.0 if group["role"] == "vector" else 0.1)
    assert {g["geometry"] for g in opt.param_groups if g["role"] == "hidden"} == {"row(p=2.5)"}
    assert create_optimizer(model, args, name="adamw_scaled").param_groups[0]["update"] == "adam"
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        create_optimizer(model, args, name="sgd")


def test_create_optimizer_warns_on_transformers_default_lr(tmp_path):
    model = tiny_gpt2(65)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.warns(UserWarning, match=r"^learning_rate is TrainingArguments' default 5e-05, an AdamW rate; "
                                         r"moga's unit steps want about 0.03125 \(its default\)"):
        opt = create_optimizer(model, args)
    assert opt.param_groups[0]["lr"] == 5e-5  # used as given, only flagged
    with pytest.warns(UserWarning, match=r"muon's unit steps want about 0.001 \(its default\)"):
        create_optimizer(model, args, name="muon")  # the published recipe's default lr
    with pytest.warns(UserWarning, match=r"muon's unit steps want about 0.02 \(its default\)"):
        create_optimizer(model, args, name="muon", preset="moga")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        create_optimizer(model, args, lr=2**-5)  # an explicit lr, or a set learning_rate, is not flagged
        create_optimizer(model, training_args(tmp_path), name="muon")


def test_vectors_are_not_decayed_whichever_way_the_optimizer_is_built(tmp_path):
    model = tiny_gpt2(65)
    built = [MOGA(model, weight_decay=0.1), create_optimizer(model, training_args(tmp_path))]
    for opt in built:
        decay = {g["role"]: g["weight_decay"] for g in opt.param_groups}
        assert decay["vector"] == 0.0 and decay["hidden"] == decay["tied"] == 0.1


def test_trainer_builds_moga_from_optimizer_cls_and_kwargs(corpus, tmp_path):
    data = CharBlocks(corpus, 8 * BATCH)
    model = tiny_gpt2(data.vocab_size)
    losses = record_losses(model)
    args = training_args(tmp_path)
    args.max_steps, args.save_strategy = 8, "no"
    # Trainer hands the optimizer class the model itself when the kwargs name it (as for LOMO).
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   optimizer_cls_and_kwargs=(MOGA, {"model": model, "lr": LR, "weight_decay": 0.1}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if "TrainingArguments" in str(w.message)]  # the arguments agree with the kwargs
    opt = trainer.optimizer.optimizer
    assert isinstance(opt, MOGA) and opt.plan["lm_head.weight"].role == "tied" and opt.skipped_steps == 0
    assert len(losses) == 8 and sum(losses[-2:]) < sum(losses[:2])
    # Without the model, the class says in one line what to pass.
    bare = transformers.Trainer(model=model, args=args, train_dataset=data,
                                optimizer_cls_and_kwargs=(MOGA, {"lr": LR}))
    with pytest.raises(ValueError, match=r"^MOGA gives each parameter .*optimizer_cls_and_kwargs=\(MOGA, "
                                         r"\{'model': model, \.\.\.\}\)[^\n]*$"):
        bare.create_optimizer()


def test_trainer_says_once_that_optimizer_cls_and_kwargs_ignores_training_arguments(tmp_path):
    """Under optimizer_cls_and_kwargs the optimizer takes its kwargs' lr and decay, not TrainingArguments';
    when they differ the user hears it once, with both values, and the kwargs' are the ones used."""
    model = tiny_gpt2(65)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, weight_decay=0.01)
    trainer = transformers.Trainer(model=model, args=args,
                                   optimizer_cls_and_kwargs=(MOGA, {"model": model, "lr": LR, "weight_decay": 0.1}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = trainer.create_optimizer()
    said = [str(w.message) for w in caught if "TrainingArguments" in str(w.message)]
    assert len(said) == 1, said
    assert said[0].startswith("Trainer(optimizer_cls_and_kwargs=(MOGA, ...)) builds MOGA from those kwargs alone: "
                              "it steps at lr 0.02 with weight_decay 0.1, and TrainingArguments' learning_rate "
                              "5e-05 and weight_decay 0.01 are ignored")
    decay = {g["role"]: (base_lr(g), g["weight_decay"]) for g in opt.param_groups}
    assert decay["hidden"] == (LR, 0.1)
    # Built outside a Trainer, the same optimizer says nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MOGA(model, lr=LR, weight_decay=0.1)


def test_trainer_resumes_with_the_same_losses(corpus, tmp_path):
    data = CharBlocks(corpus, STEPS * BATCH)

    def run(resume=None):
        model = tiny_gpt2(data.vocab_size, seed=1 if resume else 0)  # resuming must restore the weights
        losses = record_losses(model)
        opt = MOGA(model, lr=LR, weight_decay=0.1) if resume is None else create_optimizer(model, args)
        schedule = transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=4, num_training_steps=STEPS)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, schedule))
        trainer.train(resume_from_checkpoint=resume)
        return losses, trainer

    args = training_args(tmp_path)
    full, trainer = run()
    assert len(full) == STEPS and all(map(torch.isfinite, torch.tensor(full)))
    assert sum(full[-4:]) < sum(full[:4])  # it learns
    assert trainer.optimizer.optimizer.state  # Trainer wraps the MOGA instance given to it
    resumed, _ = run(tmp_path / f"checkpoint-{SAVE_AT}")
    assert resumed == full[SAVE_AT:]  # bitwise: weights, MOGA's momentum, schedule, data order and dropout RNG


def test_trainer_keeps_role_multipliers_through_its_schedule_and_a_resume(corpus, tmp_path):
    """Trainer's cosine schedule scales each role's multiplied lr; resuming into an optimizer built without
    multipliers restores them from the checkpoint, and the losses match bit for bit."""
    steps, save_at = 8, 4
    data = CharBlocks(corpus, steps * BATCH)
    multipliers = {"tied": 0.5, "vector": 2.0}

    def run(resume=None):
        model = tiny_gpt2(data.vocab_size, seed=1 if resume else 0)
        losses = record_losses(model)
        opt = create_optimizer(model, args, **({} if resume else {"lr_multipliers": multipliers}))
        schedule = transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=steps)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, schedule))
        trainer.train(resume_from_checkpoint=resume)
        return losses, opt

    args = training_args(tmp_path, max_steps=steps, save_steps=save_at)
    full, opt = run()
    resumed, opt2 = run(tmp_path / f"checkpoint-{save_at}")
    assert len(full) == steps and resumed == full[save_at:]
    for o in (opt, opt2):
        lrs = {g["role"]: g["lr"] / g["lr_multiplier"] for g in o.param_groups}
        assert len(set(lrs.values())) == 1 and {g["role"]: g["lr_multiplier"] for g in o.param_groups}["tied"] == 0.5


def test_accelerate_prepare_save_and_load_state(corpus, tmp_path):
    from accelerate import Accelerator

    data = CharBlocks(corpus, STEPS * BATCH)

    def run(resume=None):
        accelerator = Accelerator(cpu=True)
        model = tiny_gpt2(data.vocab_size, seed=1 if resume else 0)
        losses = record_losses(model)
        # Its own generator: starting to iterate must not draw from the RNG that dropout uses, or the
        # resumed run (which starts a new iterator after load_state restored that RNG) is one draw off.
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH, generator=torch.Generator().manual_seed(0))
        model, opt, loader = accelerator.prepare(model, MOGA(model, lr=LR), loader)
        if resume is not None:
            accelerator.load_state(resume)
            loader = accelerator.skip_first_batches(loader, SAVE_AT)
        for step, batch in enumerate(loader, start=SAVE_AT if resume else 0):
            loss = model(**batch).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            if step + 1 == SAVE_AT and resume is None:
                accelerator.save_state(tmp_path / "state")
        return losses

    full = run()
    assert len(full) == STEPS
    assert run(tmp_path / "state") == full[SAVE_AT:]
