"""``python -m sgl_spec.calibrate``: measurements of this model and machine that the
server reads: Krul's attention statistics (``strategy``) and restore costs
(``restore``), where sparse decode pays (``decode``), and Round Attention's watershed
layer (``watershed``)."""
