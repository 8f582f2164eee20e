//! The `mssql-cdc` command: a thin shell over the library (see `cli`).

// jemalloc unless MSSQL_CDC_ALLOCATOR=system; `alloc` says why.
#[global_allocator]
static ALLOCATOR: mssql_cdc::alloc::Allocator = mssql_cdc::alloc::Allocator;

fn main() {
    std::process::exit(mssql_cdc::cli::main());
}
