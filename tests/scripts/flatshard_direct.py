"""plain_accelerate_train.py driven by accel_flatshard's Accelerator imported directly (no register())."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import plain_accelerate_train  # noqa: E402

from accel_flatshard.integrations.accelerate import Accelerator  # noqa: E402

if __name__ == "__main__":
    plain_accelerate_train.main(accelerator_cls=Accelerator)
