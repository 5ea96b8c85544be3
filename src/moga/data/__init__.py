"""Offline data: image classification sets as in-memory tensors, and nanoGPT-style token streams.

Nothing here downloads. Images: `load_image_dataset("digits" | "fashion-mnist" | "cifar10" |
"cifar100", root)`. Text: `prepare_text(out_dir, text_file, tokenizer)` then `TokenDataset(out_dir)`.
"""

from .augment import channel_stats, normalize, random_crop, random_hflip, to_float
from .cifar import CIFAR10_CLASSES, decode_image_tree, load_image_tree, read_cifar_pickles
from .dataset import ImageBatches, ImageDataset, Split, build_image_dataset, split_train_val
from .idx import read_idx
from .images import (
    FASHION_MNIST_DIR,
    IMAGE_DATASETS,
    STANDARD_STATS,
    load_cifar10,
    load_cifar100,
    load_digits,
    load_fashion_mnist,
    load_image_dataset,
)
from .paths import cache_dir
from .sampler import BatchSampler, derive_seed, make_generator
from .text import TokenBatches, TokenDataset, prepare_text, read_meta, resolve_text_corpus
from .tokenizers import (
    GPT2_VOCAB_SIZE,
    ByteTokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    find_gpt2_ranks,
    get_tokenizer,
    tokenizer_from_meta,
)

__all__ = [
    "BatchSampler", "ByteTokenizer", "CIFAR10_CLASSES", "CharTokenizer", "FASHION_MNIST_DIR", "GPT2Tokenizer",
    "GPT2_VOCAB_SIZE", "IMAGE_DATASETS", "ImageBatches", "ImageDataset", "STANDARD_STATS", "Split",
    "TokenBatches", "TokenDataset", "build_image_dataset", "cache_dir", "channel_stats", "decode_image_tree",
    "derive_seed", "find_gpt2_ranks", "get_tokenizer", "load_cifar10", "load_cifar100", "load_digits",
    "load_fashion_mnist", "load_image_dataset", "load_image_tree", "make_generator", "normalize",
    "prepare_text", "random_crop", "random_hflip", "read_cifar_pickles", "read_idx", "read_meta",
    "resolve_text_corpus", "split_train_val", "to_float", "tokenizer_from_meta",
]
