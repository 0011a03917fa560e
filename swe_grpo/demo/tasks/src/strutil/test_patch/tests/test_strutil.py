import pytest
from strutil import slugify, truncate


def test_slugify_words():
    assert slugify("Hello, World!") == "hello-world"


def test_slugify_accents_and_separator():
    assert slugify("Crème Brûlée", sep="_") == "creme_brulee"


def test_truncate_short_text_unchanged():
    assert truncate("short", 10) == "short"


def test_truncate_rejects_tiny_width():
    with pytest.raises(ValueError):
        truncate("hello", 2)


def test_truncate_fits_width():
    assert truncate("hello world", 8) == "hello..."


def test_truncate_custom_placeholder():
    assert truncate("abcdefghij", 5, placeholder="~") == "abcd~"
