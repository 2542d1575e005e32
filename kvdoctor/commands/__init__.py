"""Click faces of the commands that have moved into their own modules (click only: they read
input through ``kvdoctor.inputs`` and ``kvdoctor.sampler`` and compute no diagnosis)."""
