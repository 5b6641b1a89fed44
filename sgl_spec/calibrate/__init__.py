"""``python -m sgl_spec.calibrate``: measurements of this model and machine that the
server reads (Krul's attention statistics; the restore calibration comes next)."""
