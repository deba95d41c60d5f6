"""An independent FP8 / MX reference in numpy (float64), written from the formats' specs."""

from __future__ import annotations

import math

import numpy as np

FORMATS = {
    # name: (exponent bits, mantissa bits, bias, has_inf)
    "e4m3fn": (4, 3, 7, False),
    "e5m2": (5, 2, 15, True),
}
EMAX_ELEM = {"e4m3fn": 8, "e5m2": 15}


def decode(name: str) -> np.ndarray:
    """Value of each of the 256 codes (NaN for NaN codes)."""
    ebits, mbits, bias, has_inf = FORMATS[name]
    values = np.empty(256)
    for code in range(256):
        sign = -1.0 if code >> 7 else 1.0
        exponent = (code >> mbits) & ((1 << ebits) - 1)
        mantissa = code & ((1 << mbits) - 1)
        top = (1 << ebits) - 1
        if has_inf and exponent == top:
            values[code] = sign * math.inf if mantissa == 0 else math.nan
        elif not has_inf and exponent == top and mantissa == (1 << mbits) - 1:
            values[code] = math.nan
        elif exponent == 0:
            values[code] = sign * mantissa / (1 << mbits) * 2.0 ** (1 - bias)
        else:
            values[code] = sign * (1 + mantissa / (1 << mbits)) * 2.0 ** (exponent - bias)
    return values


def max_finite(name: str) -> float:
    values = decode(name)
    return float(np.nanmax(values[np.isfinite(values)]))


def round_to_format(values: np.ndarray, name: str) -> np.ndarray:
    """Nearest finite value, ties to the even code; saturating; NaN stays NaN."""
    table = decode(name)
    codes = np.array([c for c in range(128) if np.isfinite(table[c])])  # non-negative
    grid = table[codes]
    order = np.argsort(grid)
    grid, codes = grid[order], codes[order]
    out = np.empty_like(values, dtype=np.float64)
    for index, value in np.ndenumerate(values):
        if math.isnan(value):
            out[index] = math.nan
            continue
        magnitude = min(abs(value), grid[-1])
        upper = int(np.searchsorted(grid, magnitude))
        if grid[min(upper, len(grid) - 1)] == magnitude:
            chosen = grid[upper]
        else:
            low, high = grid[upper - 1], grid[upper]
            if magnitude - low < high - magnitude:
                chosen = low
            elif magnitude - low > high - magnitude:
                chosen = high
            else:
                chosen = low if codes[upper - 1] % 2 == 0 else high
        out[index] = math.copysign(chosen, value)
    return out


def float8_reference(x: np.ndarray, name: str) -> tuple[np.ndarray, np.float32]:
    """Per-tensor current scaling: values of the quantized data, and scale_inv."""
    x32 = x.astype(np.float32)
    finite = np.isfinite(x32)
    amax = np.float32(np.abs(x32[finite]).max()) if finite.any() else np.float32(0)
    scale = np.float32(max_finite(name)) / amax if amax > 0 else np.float32(1)
    scaled = np.clip(x32 * np.float32(scale), -max_finite(name), max_finite(name))
    return round_to_format(scaled.astype(np.float64), name), np.float32(1) / np.float32(scale)


def mx_reference(x: np.ndarray, name: str, block: int) -> tuple[np.ndarray, np.ndarray]:
    """OCP MX v1.0 along the last dimension: element values and E8M0 scale bytes."""
    rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
    data = np.empty(rows.shape)
    scales = np.empty((rows.shape[0], rows.shape[1] // block), dtype=np.uint8)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // block):
            chunk = rows[r, b * block : (b + 1) * block].astype(np.float64)
            finite = chunk[np.isfinite(chunk)]
            amax = np.abs(finite).max() if finite.size else 0.0
            if amax == 0:
                shared = -127
            else:
                shared = max(-127, min(127, math.frexp(amax)[1] - 1 - EMAX_ELEM[name]))
            scales[r, b] = shared + 127
            scaled = np.clip(chunk / 2.0**shared, -max_finite(name), max_finite(name))
            data[r, b * block : (b + 1) * block] = round_to_format(scaled, name)
    return data.reshape(x.shape), scales.reshape(*x.shape[:-1], -1)
