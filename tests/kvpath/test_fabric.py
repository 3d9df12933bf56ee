import pytest

from kvpath.fabric import FabricSpec, FabricSpecError, check_pools_fit, pd_placement


def test_addressing_is_hierarchical_and_reversible():
    f = FabricSpec(leaves=3, spines=2, hosts_per_leaf=4)
    assert len(f.hosts()) == 12
    assert f.host_ip("l2h3") == "10.2.5.1"
    assert f.canonical("10.2.5.1") == "l2h3"
    for bad in ("l3h0", "l0h4", "11.0.2.1", "nonsense", "10.0.1.1"):
        with pytest.raises(FabricSpecError):
            f.locate(bad)


def test_paths_follow_the_up_down_rule():
    f = FabricSpec(leaves=2, spines=4, hosts_per_leaf=2)
    assert f.path("l0h0", "l0h1").nodes == ("l0h0", "leaf0", "l0h1")
    p = f.path("l0h0", "l1h1", spine=2)
    assert p.nodes == ("l0h0", "leaf0", "spine2", "leaf1", "l1h1") and p.spine == "spine2"
    assert p.links[1] == ("leaf0", "spine2")
    with pytest.raises(FabricSpecError):
        f.path("l0h0", "l1h0")


def test_ecmp_hash_is_deterministic_spreads_and_depends_on_seed():
    f = FabricSpec(leaves=2, spines=4, hosts_per_leaf=2, ecmp_seed=1)
    spines = [f.flow_path("l0h0", "l1h0", sport, 5000).spine for sport in range(40000, 40400)]
    assert spines == [f.flow_path("l0h0", "l1h0", sport, 5000).spine for sport in range(40000, 40400)]
    counts = {s: spines.count(s) for s in set(spines)}
    assert len(counts) == 4 and min(counts.values()) > 60  # roughly uniform
    g = FabricSpec(leaves=2, spines=4, hosts_per_leaf=2, ecmp_seed=2)
    assert spines != [g.flow_path("l0h0", "l1h0", sport, 5000).spine for sport in range(40000, 40400)]
    # hash fields that exclude ports: every port takes the same path
    h = FabricSpec(leaves=2, spines=4, hosts_per_leaf=2, ecmp_hash_fields=("src_ip", "dst_ip"))
    assert len({h.flow_path("l0h0", "l1h0", p, 5000).spine for p in range(100)}) == 1


@pytest.mark.parametrize(
    "d, field",
    [({"leaves": 0}, "leaves"), ({"spines": "4"}, "spines"), ({"mtu": 100}, "mtu"),
     ({"ecmp_hash_fields": ["src_mac"]}, "ecmp_hash_fields"), ({"spine_link_gbps": -1}, "spine_link_gbps"),
     ({"bogus": 1}, "bogus"), ({"base_net": "10.0.0.0/16"}, "base_net")],
)
def test_bad_spec_names_the_field(d, field):
    with pytest.raises(FabricSpecError, match=field):
        FabricSpec.from_dict(d)


def test_roundtrip(tmp_path):
    f = FabricSpec(leaves=2, spines=3, ecmp_seed=7)
    p = tmp_path / "f.json"
    import json

    p.write_text(json.dumps(f.to_dict()))
    assert FabricSpec.load(p) == f


def test_presets_and_spec_files(tmp_path):
    assert (FabricSpec.resolve("small").leaves, FabricSpec.resolve("small").spines) == (2, 2)
    r4, r8 = FabricSpec.resolve("rack4"), FabricSpec.resolve("rack8")
    assert (r4.leaves, r4.spines, r4.hosts_per_leaf) == (4, 4, 4)
    assert (r8.leaves, r8.spines, r8.hosts_per_leaf) == (8, 4, 2)
    y = tmp_path / "f.yaml"
    y.write_text("leaves: 3\nspines: 2\nhosts_per_leaf: 1\necmp_seed: 9\n")
    assert FabricSpec.resolve(str(y)) == FabricSpec(leaves=3, spines=2, hosts_per_leaf=1, ecmp_seed=9)
    y.write_text("leaves: 3\nspine_count: 2\n")
    with pytest.raises(FabricSpecError, match="spine_count"):
        FabricSpec.resolve(str(y))
    y.write_text("leaves: [3\n")
    with pytest.raises(FabricSpecError, match="cannot read"):
        FabricSpec.resolve(str(y))
    with pytest.raises(FabricSpecError, match="neither a preset"):
        FabricSpec.resolve("rack5")
    with pytest.raises(FabricSpecError, match="spines"):
        FabricSpec(spines=64)


def test_link_addresses_are_hierarchical_and_distinct():
    f = FabricSpec(leaves=4, spines=4, hosts_per_leaf=4)
    ips = [f.host_ip(h) for h in f.hosts()] + [f.host_gateway_ip(h) for h in f.hosts()]
    ips += [ip for l in range(4) for s in range(4) for ip in f.uplink_ips(l, s)]
    assert len(ips) == len(set(ips))
    assert f.uplink_ips(2, 3) == ("10.2.1.13", "10.2.1.14")
    import ipaddress

    for l in range(4):
        net = ipaddress.ip_network(f.leaf_prefix(l))
        assert all(ipaddress.ip_address(f.host_ip(h)) in net for h in f.hosts() if h.startswith(f"l{l}h"))


def test_addresses_reach_64k_hosts_and_locate_back():
    f = FabricSpec(leaves=256, spines=32, hosts_per_leaf=256)
    hosts = f.hosts()
    assert len(hosts) == 65_536
    ips = [f.host_ip(h) for h in hosts]
    gws = [f.host_gateway_ip(h) for h in hosts]
    assert len(set(ips) | set(gws)) == 2 * len(hosts)
    # the first 254 hosts of a leaf keep <base>.<l>.<h+2>.1; the next ones take the next /30
    assert (f.host_ip("l0h253"), f.host_ip("l0h254"), f.host_ip("l255h255")) == ("10.0.255.1", "10.0.2.5", "10.255.3.5")
    assert f.host_gateway_ip("l0h254") == "10.0.2.6"
    import ipaddress

    for h, ip, gw in zip(hosts, ips, gws):
        assert f.canonical(ip) == h and f.canonical(gw) == h
        a, b = ipaddress.ip_address(ip), ipaddress.ip_address(gw)
        assert int(a) % 4 == 1 and int(b) == int(a) + 1  # host and leaf sides of one /30
    # leaf-spine link addresses (<base>.<l>.1.x) never name a host
    with pytest.raises(FabricSpecError, match="not a host"):
        f.locate(f.uplink_ips(3, 2)[0])


def test_fabric_size_limits_name_the_field():
    FabricSpec(leaves=256, hosts_per_leaf=254 * 64)
    with pytest.raises(FabricSpecError, match="fabric.leaves"):
        FabricSpec(leaves=257)
    with pytest.raises(FabricSpecError, match="fabric.hosts_per_leaf"):
        FabricSpec(hosts_per_leaf=254 * 64 + 1)


def test_placement_spreads_p_and_d_over_their_halves_and_refuses_pools_that_do_not_fit():
    spec = FabricSpec(leaves=2, spines=2, hosts_per_leaf=2)
    assert pd_placement(spec, 2, 1) == ([spec.host_name(0, 0), spec.host_name(0, 1)], [spec.host_name(1, 0)])
    # one rule for the testbed, the simulation and placement: raise, never truncate
    with pytest.raises(ValueError, match=r"pools 3P1D do not fit: 2 hosts for P and 2 for D"):
        pd_placement(spec, 3, 1)
    with pytest.raises(ValueError, match="at least one P and one D"):
        check_pools_fit(spec, 0, 1)
    with pytest.raises(ValueError, match="at least 2 leaves"):
        check_pools_fit(FabricSpec(leaves=1, spines=1, hosts_per_leaf=4), 1, 1)
