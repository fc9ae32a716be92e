//! TODO(lead): being written
