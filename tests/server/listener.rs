//! The public listener: header, body and idle timeouts, the per-client connection cap, and
//! the error envelope on refusals made before a request reaches a handler.
