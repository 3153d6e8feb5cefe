//! Engine tests (accelerated clock).
