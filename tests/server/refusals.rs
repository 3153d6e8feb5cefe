//! Clean refusals: every bad input gets its 4xx with the error envelope, on both backends,
//! and changes nothing.
