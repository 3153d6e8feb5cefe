//! Trust no node: frames accepted only from the node holding the attempt, usage bounded by
//! the request, retries away from a failing node.
