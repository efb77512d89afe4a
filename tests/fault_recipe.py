"""The llama3 recipe as one process of a launched run, with a mistake injected into one
process's command line: `TOT_TEST_EXTRA_FLAG=1:--lr=0.001` adds `--lr=0.001` to process 1's
flags (tests/test_process_faults.py, tools/fault_table.py)."""

import os
import sys

from recipes import cli, llama3

if __name__ == "__main__":
  index, _, flag = os.environ.get("TOT_TEST_EXTRA_FLAG", "").partition(":")
  if flag and os.environ.get("TOT_PROCESS_ID") == index:
    sys.argv.append(flag)
  cli.fire_main(llama3.main)
