"""One module per tensor-parallel scheme, all implementing layouts/base.py."""

from .cube import CubeLayout
from .oned import OneDLayout
from .serial import SerialLayout
from .tesseract import TesseractLayout, TwoDLayout

LAYOUTS = {
    "serial": SerialLayout,
    "1d": OneDLayout,
    "2d": TwoDLayout,
    "2.5d": TesseractLayout,
    "3d": CubeLayout,
}
