"""The fault catalogue: every mistake and fault a new user may meet (bad values, data, Hugging
Face folders, checkpoints, script arguments, the launcher's environment, signals, disks and
files removed under a live run), each run as that user would, with one verdict per case
(harness.py says what HELD, BENT and BROKE mean). tests/test_catalogue.py runs every case as a
test of its own; scripts/fault_catalogue.py prints the verdicts as a table."""

from faults import (  # noqa: F401 - each module registers its cases
    cases_checkpoint,
    cases_config,
    cases_data,
    cases_doors,
    cases_hf,
    cases_run_folder,
    cases_scripts,
    cases_signals,
    cases_stops,
)
from faults.harness import CASES, Case, Catalogue, verdict  # noqa: F401
