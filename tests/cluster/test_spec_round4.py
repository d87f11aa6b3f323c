"""Spec deviations round 4 (issue 44), rank-population law side. Each test quotes the clause of
shared/spec/rank-population-law.txt it enforces and was written from those words before the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from kiln.system import ranks
from kiln.system.ranks import ObservationInputError, decide_rank_population, parse_observation_json
from tests.cluster.test_rank_law_witnesses import _participant, observed_shape


def decide(obs: dict[str, Any]):
    return decide_rank_population(parse_observation_json(json.dumps(obs).encode()))


# ---- item 5 -------------------------------------------------------------------------------
# "The selected hosts are distinct identities. Both directions of the host join are existence
#  checks, so [A, A] with both ranks on A passed every one of them — a single machine presenting
#  as a pair". A resolver reads 3232261642, 0xc0a8660a and ::ffff:192.168.102.10 as one address.

SAME_MACHINE = ["3232261642", "0xc0a8660a", "0XC0A8660A", "192.168.26122", "192.11036170",
                "::ffff:192.168.102.10", "[::ffff:c0a8:660a]"]


@pytest.mark.parametrize("spelling", SAME_MACHINE)
def test_every_address_spelling_of_one_machine_is_one_host(spelling):
    assert ranks.canonical_host(spelling) == "192.168.102.10"
    obs = observed_shape()
    obs["selected_hosts"] = ["192.168.102.10", spelling]
    obs["participants"] = [_participant(0, "192.168.102.10", "46055"), _participant(1, spelling, "3764")]
    findings = decide(obs).to_json_dict()["findings"]
    assert {"kind": "selected_host_named_more_than_once", "host": "192.168.102.10", "occurrences": 2} in findings


def test_short_ipv4_forms_are_their_address():
    assert ranks.canonical_host("127.1") == "127.0.0.1"
    assert ranks.canonical_host("0x7f.1") == "127.0.0.1"


@pytest.mark.parametrize("ambiguous", ["192.168.102.010", "0300.0250.0146.012", "010.1", "0377"])
def test_octal_looking_components_are_refused_as_ambiguous(ambiguous):
    """A leading zero is octal to inet_aton and decimal to a reader: which machine is meant is ambiguous."""
    with pytest.raises(ValueError, match="ambiguous"):
        ranks.canonical_host(ambiguous)
    obs = observed_shape()
    obs["selected_hosts"] = ["192.168.102.10", ambiguous]
    with pytest.raises(ObservationInputError):
        parse_observation_json(json.dumps(obs).encode())


def test_distinct_addresses_and_names_stay_distinct():
    # positive control: the fold never merges two machines
    assert ranks.canonical_host("192.168.102.11") != ranks.canonical_host("3232261642")
    assert ranks.canonical_host("host-10") == "host-10"
    assert ranks.canonical_host("::ffff:192.168.102.11") == "192.168.102.11"
    obs = observed_shape()
    obs["selected_hosts"] = ["3232261642", "192.168.102.11"]
    obs["participants"] = [_participant(0, "192.168.102.10", "1"), _participant(1, "0xc0a8660b", "2")]
    assert decide(obs).coherent


# ---- also (no spec clause; same class as the round-3 distill fix) --------------------------
# Every reader of a user-named path refuses a non-regular file instead of blocking on it.


def test_ranks_check_on_a_fifo_refuses_at_once(tmp_path):
    fifo = tmp_path / "obs.json"
    os.mkfifo(fifo)
    try:
        proc = subprocess.run([sys.executable, "-m", "kiln.cli", "ranks", "check", str(fifo)], capture_output=True,
                              text=True, timeout=60, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        pytest.fail("kiln ranks check blocked on a FIFO")
    assert proc.returncode == 2 and proc.stdout == "" and "regular file" in proc.stderr, proc.stderr


def test_ranks_check_reads_stdin_and_regular_files(tmp_path):
    # positive control: '-' and a regular file are still read
    path = tmp_path / "obs.json"
    path.write_text(json.dumps(observed_shape()))
    for args, stdin in (([str(path)], None), (["-"], path.read_text())):
        proc = subprocess.run([sys.executable, "-m", "kiln.cli", "ranks", "check", *args], input=stdin,
                              capture_output=True, text=True, timeout=60, env=os.environ.copy())
        assert proc.returncode == 0 and json.loads(proc.stdout)["decision"] == "coherent", proc.stderr
