import pytest

from autopar import Mesh
from autopar.core.placement import P, R, S, format_placements, parse_placements, parse_placements_text


def test_mesh_defaults_axis_names_and_counts_devices():
    mesh = Mesh((2, 4))
    assert mesh.axis_names == ("axis0", "axis1")
    assert mesh.size == 8 and mesh.ndim == 2


def test_mesh_coordinate_is_row_major():
    mesh = Mesh((2, 3), ("dp", "tp"))
    assert [mesh.coordinate(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


@pytest.mark.parametrize(
    "shape, names, match",
    [
        ((), (), "non-empty"),
        ((2, 0), ("a", "b"), "positive"),
        ((2, 2), ("dp",), "one name per axis"),
        ((2, 2), ("dp", "dp"), "distinct"),
    ],
)
def test_mesh_rejects_bad_shapes_with_the_reason(shape, names, match):
    with pytest.raises(ValueError, match=match):
        Mesh(shape, names)


def test_placements_print_short_and_parse_back():
    placements = (S(0), R, P)
    text = format_placements(placements)
    assert text == "(S(0), R, P)"
    assert parse_placements_text(text) == placements
    assert parse_placements("S(1)", 1) == (S(1),)
    assert parse_placements(["R", "S(0)"], 2) == (R, S(0))


def test_placements_reject_wrong_axis_count_and_bad_text():
    with pytest.raises(ValueError, match="name 1 mesh axes; the mesh has 2"):
        parse_placements("R", 2)
    with pytest.raises(ValueError, match="cannot read placement 'Shard0'"):
        parse_placements("Shard0", 1)
