"""Integrations with training frameworks: ``accelerate`` (the Accelerate backend), ``config`` (accelerate's
configuration as options), ``state_io`` (its checkpoints), ``trainer_trl_peft`` and ``versions``.  Nothing is
imported here: ``accel_flatshard.Accelerator`` loads the backend on first use, so ``import accel_flatshard`` does not
import accelerate."""
