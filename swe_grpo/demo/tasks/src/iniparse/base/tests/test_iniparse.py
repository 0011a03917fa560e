import pytest
from iniparse import ParseError, parse


def test_sections_and_keys(sample):
    assert parse(sample) == {"": {"name": "demo"}, "server": {"host": "localhost", "port": "8080"}}


def test_comments_and_blank_lines():
    assert parse("; only a comment\n\n# another\n") == {"": {}}


def test_bad_line_names_its_number():
    with pytest.raises(ParseError, match="line 2"):
        parse("[a]\nnot a pair\n")
