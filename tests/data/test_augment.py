import pytest
import torch

from moga.data import channel_stats, normalize, random_crop, random_hflip


def images(n=16, c=3, h=8, w=8, seed=0):
    return torch.randint(1, 256, (n, c, h, w), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def windows(image, padding):
    """Every H x W window of the zero-padded image."""
    padded = torch.nn.functional.pad(image, (padding,) * 4)
    h, w = image.shape[-2:]
    return [padded[:, i:i + h, j:j + w] for i in range(2 * padding + 1) for j in range(2 * padding + 1)]


def test_random_crop_keeps_shape_and_cuts_a_window_of_the_padded_image():
    x = images()
    out = random_crop(x, 4, torch.Generator().manual_seed(1))
    assert out.shape == x.shape and out.dtype == x.dtype
    for image, crop in zip(x, out):
        assert any(torch.equal(crop, w) for w in windows(image, 4))
    # Pixels are never zero in x, so zeros show the padding: some crops must have shifted.
    assert (out == 0).any(dim=(1, 2, 3)).sum() > len(x) // 2


def test_random_crop_offsets_cover_the_whole_range():
    x = torch.ones(2000, 1, 4, 4, dtype=torch.uint8)
    out = random_crop(x, 2, torch.Generator().manual_seed(0))
    rows = (out[:, 0] != 0).any(-1).int()  # [N, 4]: which rows hold image rather than padding
    leading = rows.argmax(1)
    trailing = rows.flip(1).argmax(1)
    assert set((trailing - leading).tolist()) == {-2, -1, 0, 1, 2}  # every vertical shift occurs

def test_random_crop_without_padding_is_the_identity():
    x = images()
    assert torch.equal(random_crop(x, 0, torch.Generator().manual_seed(0)), x)


def test_augmentation_is_deterministic_given_the_generator():
    x = images(64)
    run = lambda seed: random_hflip(random_crop(x, 4, torch.Generator().manual_seed(seed)),  # noqa: E731
                                    torch.Generator().manual_seed(seed))
    assert torch.equal(run(3), run(3))
    assert not torch.equal(run(3), run(4))


def test_hflip_really_flips_left_right():
    x = images(64)
    assert torch.equal(random_hflip(x, torch.Generator(), p=1.0), x.flip(-1))
    assert torch.equal(random_hflip(x, torch.Generator(), p=0.0), x)
    out = random_hflip(x, torch.Generator().manual_seed(0))
    flipped = torch.tensor([torch.equal(o, i.flip(-1)) for o, i in zip(out, x)])
    unchanged = torch.tensor([torch.equal(o, i) for o, i in zip(out, x)])
    assert (flipped ^ unchanged).all()  # each image is either mirrored or untouched
    assert 16 < flipped.sum() < 48
    assert torch.equal(out[flipped][..., 0], x[flipped][..., -1])  # first column is the old last column


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_channel_stats_match_a_direct_computation(dtype):
    x = images(50, h=5, w=7)
    x = x if dtype == torch.uint8 else x.float() / 255
    mean, std = channel_stats(x, chunk=7)
    flat = (x.double() / (255 if dtype == torch.uint8 else 1)).transpose(0, 1).reshape(3, -1)
    torch.testing.assert_close(mean, flat.mean(1).float())
    torch.testing.assert_close(std, flat.std(1, unbiased=False).float())
    z = normalize(flat.float().T.reshape(-1, 3, 1, 1), mean, std)
    torch.testing.assert_close(z.mean((0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
