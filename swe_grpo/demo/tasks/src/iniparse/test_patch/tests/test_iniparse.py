import pytest
from iniparse import ParseError, parse


def test_sections_and_keys(sample):
    assert parse(sample) == {"": {"name": "demo"}, "server": {"host": "localhost", "port": "8080"}}


def test_comments_and_blank_lines():
    assert parse("; only a comment\n\n# another\n") == {"": {}}


def test_bad_line_names_its_number():
    with pytest.raises(ParseError, match="line 2"):
        parse("[a]\nnot a pair\n")


def test_value_containing_equals():
    text = "[db]\nurl = postgres://db/app?sslmode=require\n"
    assert parse(text) == {"": {}, "db": {"url": "postgres://db/app?sslmode=require"}}


def test_key_without_spaces_and_equals_in_value():
    assert parse("expr=a=b")[""] == {"expr": "a=b"}
