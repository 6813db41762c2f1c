//! ncclNet v12, the newest ABI: every member is [`plugin`](super::plugin)'s entry point as it
//! is (see [`entries`](super::entries)); nothing is v12's alone.
