/// glibc's malloc was a tenth of the runner's CPU, and more beside the embedded store, whose
/// long-lived memtable entries fragment its heap. jemalloc cost 0.84-0.9x the CPU per message
/// at the same peak RSS (BENCHMARKS.md); mimalloc saved as much but held 20 MiB more.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    sluice::cli::main()
}
