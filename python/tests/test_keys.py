"""The LMCache object key encoding of the L1 tier reference, §2.1."""

import pytest

from cxlkv import ObjectKey, object_key


def test_the_specs_example_encodes_exactly():
    assert object_key("m", 0xABCD, bytes([0, 0, 0, 1]), 0) == "m@0000abcd@00000001@0"


def test_the_salt_is_appended_only_when_non_empty():
    assert object_key("m", 1, b"\xff", 2, "") == "m@00000001@ff@2"
    assert object_key("m", 1, b"\xff", 2, "tenant-a") == "m@00000001@ff@2@tenant-a"


def test_fields_use_their_bases_and_cases():
    k = ObjectKey("Llama-3-8B", 0xDEADBEEF, bytes.fromhex("00AbCdEf"), 12)
    assert str(k) == "Llama-3-8B@deadbeef@00abcdef@12"
    assert k.encode() == b"Llama-3-8B@deadbeef@00abcdef@12"


def test_equality_covers_all_five_fields():
    base = ObjectKey("m", 0, b"\x01", 0, "")
    assert base == ObjectKey("m", 0, b"\x01")
    for other in [
        ObjectKey("n", 0, b"\x01"),
        ObjectKey("m", 1, b"\x01"),
        ObjectKey("m", 0, b"\x02"),
        ObjectKey("m", 0, b"\x01", 1),
        ObjectKey("m", 0, b"\x01", 0, "s"),
    ]:
        assert base != other and str(base) != str(other)


def test_out_of_range_ranks_and_non_bytes_hashes_are_refused():
    with pytest.raises(ValueError):
        object_key("m", 1 << 32, b"\x00")
    with pytest.raises(ValueError):
        object_key("m", -1, b"\x00")
    with pytest.raises(TypeError):
        str(ObjectKey("m", 0, "00ff"))


def test_an_integer_hash_is_refused_not_zero_filled():
    with pytest.raises(TypeError):
        object_key("m", 0, 5)


@pytest.mark.parametrize(
    "fields",
    [
        (b"m", 0, b"\x01"),  # would be the model "b'm'"
        (None, 0, b"\x01"),  # "None"
        ("m", 0, b"\x01", 0, b"salt"),  # the salt "b'salt'"
        ("m", 0, b"\x01", 0, None),  # no salt: "@None" would follow
        ("m", 1.0, b"\x01"),  # a rank is an int
        ("m", 0, b"\x01", 1.5),  # a group is an int
    ],
)
def test_a_field_of_the_wrong_type_is_refused_not_formatted_into_another_key(fields):
    # str() of bytes or None is text too: the key would silently differ
    # from the one another process encodes from the same str fields.
    with pytest.raises(TypeError):
        object_key(*fields)
    with pytest.raises(TypeError):
        ObjectKey(*fields).encode()
