import pytest
import torch

from moga.data import BatchSampler, load_digits, split_train_val


def test_sampler_epoch_is_a_permutation_and_epochs_differ():
    sampler = BatchSampler(103, 10, seed=0, shuffle=True, drop_last=False)
    assert len(sampler) == 11
    first = torch.cat(list(sampler.epoch_batches()))
    second = torch.cat(list(sampler.epoch_batches()))
    assert sorted(first.tolist()) == list(range(103)) == sorted(second.tolist())
    assert not torch.equal(first, second)
    assert sampler.state_dict() == {"seed": 0, "epoch": 2, "index": 0}


def test_sampler_drop_last_and_order():
    sampler = BatchSampler(25, 10, shuffle=False, drop_last=True)
    assert [b.tolist() for b in sampler.epoch_batches()] == [list(range(10)), list(range(10, 20))]
    assert torch.equal(next(sampler), torch.arange(10))  # rolled over into epoch 1


def test_sampler_depends_only_on_seed_and_position():
    a, b = BatchSampler(50, 8, seed=7), BatchSampler(50, 8, seed=7)
    assert all(torch.equal(next(a), next(b)) for _ in range(20))
    assert not torch.equal(next(BatchSampler(50, 8, seed=8)), next(BatchSampler(50, 8, seed=7)))
    resumed = BatchSampler(50, 8, seed=7)
    resumed.load_state_dict(a.state_dict())
    assert all(torch.equal(next(a), next(resumed)) for _ in range(20))
    with pytest.raises(ValueError, match="seed"):
        BatchSampler(50, 8, seed=1).load_state_dict(a.state_dict())


def test_split_is_deterministic_disjoint_and_sized():
    train, val = split_train_val(50_000, 5_000, seed=0)
    assert (len(train), len(val)) == (45_000, 5_000)
    assert torch.equal(torch.cat([train, val]).sort().values, torch.arange(50_000))
    again_train, again_val = split_train_val(50_000, 5_000, seed=0)
    assert torch.equal(val, again_val) and torch.equal(train, again_train)
    assert not torch.equal(val, split_train_val(50_000, 5_000, seed=1)[1])
    assert len(split_train_val(100, 0.25)[1]) == 25
    with pytest.raises(ValueError, match="no training data"):
        split_train_val(10, 10)


def test_image_batches_resume_bit_for_bit(cifar_small):
    run = cifar_small.batches("train", 32, seed=3)
    assert len(run) == len(cifar_small.train) // 32
    for _ in range(len(run) - 2):  # stop just before an epoch boundary
        next(run)
    state = run.state_dict()
    expected = [next(run) for _ in range(6)]  # crosses into the next epoch
    assert run.epoch == 1
    resumed = cifar_small.batches("train", 32, seed=3)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, (next(resumed) for _ in range(6))):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_training_batches_are_augmented_and_eval_batches_are_not(cifar_small):
    augmented, _ = next(cifar_small.batches("train", 64, seed=0))
    plain, _ = next(cifar_small.batches("train", 64, seed=0, augment=False))
    assert augmented.shape == plain.shape == (64, 3, 32, 32)
    assert not torch.equal(augmented, plain)
    xs, ys = zip(*cifar_small.eval_batches("test", 100))
    assert torch.equal(torch.cat(ys), cifar_small.test.y)
    torch.testing.assert_close(torch.cat(xs), cifar_small.transform(cifar_small.test.x))


def test_flattened_batches_for_mlps():
    digits = load_digits(flatten=True)
    x, y = next(digits.batches("train", 16))
    assert digits.input_shape == (64,) and x.shape == (16, 64) and y.shape == (16,)
    assert digits.image_shape == (1, 8, 8)
