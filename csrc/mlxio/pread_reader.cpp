#include "mlxio/pread_reader.h"

#include <algorithm>
#include <cerrno>
#include <new>
#include <thread>

#include "core/errors.h"
#include "core/file.h"

namespace mx = mlx::core;

namespace pyloader {

namespace {

size_t default_threads(size_t requested) {
  if (requested) return requested;
  size_t hw = std::thread::hardware_concurrency();
  return std::max<size_t>(hw, 1);
}

struct Chunk {
  uint32_t file;
  uint64_t offset;
  uint8_t* dst;
  size_t len;
};

}  // namespace

PreadReader::PreadReader(std::shared_ptr<const TensorIndex> index, PreadOptions options)
    : index_(std::move(index)),
      options_(options),
      pool_(default_threads(options.threads) - 1) {
  if (options_.chunk_bytes == 0) options_.chunk_bytes = 16ull << 20;
}

NamedArrays PreadReader::load(const std::vector<std::string>& names) {
  std::vector<const TensorInfo*> wanted;
  wanted.reserve(names.size());
  for (const auto& n : names) wanted.push_back(&index_->at(n));
  return read(wanted);
}

NamedArrays PreadReader::load_all() {
  std::vector<const TensorInfo*> wanted;
  wanted.reserve(index_->tensors().size());
  for (const auto& t : index_->tensors()) wanted.push_back(&t);
  return read(wanted);
}

NamedArrays PreadReader::read(const std::vector<const TensorInfo*>& wanted) {
  // Allocate every destination first so a failure happens before any I/O.
  NamedArrays out;
  out.reserve(wanted.size());
  std::vector<Chunk> chunks;
  std::vector<int> file_used(index_->files().size(), 0);
  uint64_t total = 0;
  for (const TensorInfo* t : wanted) {
    uint8_t* dst = nullptr;
    out.emplace_back(t->name, allocate_array(*t, index_->files()[t->file].path, &dst));
    if (t->nbytes && !dst) throw std::bad_alloc();
    file_used[t->file] = 1;
    for (uint64_t done = 0; done < t->nbytes; done += options_.chunk_bytes) {
      size_t len = static_cast<size_t>(std::min<uint64_t>(options_.chunk_bytes, t->nbytes - done));
      chunks.push_back({t->file, t->offset + done, dst + done, len});
    }
    total += t->nbytes;
  }
  // Read in file order: sequential runs per file help readahead.
  std::sort(chunks.begin(), chunks.end(), [](const Chunk& a, const Chunk& b) {
    return a.file != b.file ? a.file < b.file : a.offset < b.offset;
  });

  std::vector<std::unique_ptr<File>> files(index_->files().size());
  for (size_t i = 0; i < files.size(); ++i) {
    if (!file_used[i]) continue;
    files[i] = std::make_unique<File>(File::open_read(index_->files()[i].path));
    if (files[i]->size() != index_->files()[i].size)
      throw IoError("pread (file changed size since its header was read)",
                    files[i]->path(), ESTALE);
  }
  pool_.run(chunks.size(), [&](size_t i) {
    const Chunk& c = chunks[i];
    files[c.file]->read_exact(c.dst, c.len, c.offset);
  });

  std::lock_guard<std::mutex> lk(stats_mutex_);
  stats_.tensors += wanted.size();
  stats_.bytes += total;
  stats_.bytes_read += total;
  stats_.copied_tensors += wanted.size();
  stats_.copied_bytes += total;
  return out;
}

ReaderStats PreadReader::stats() const {
  std::lock_guard<std::mutex> lk(stats_mutex_);
  return stats_;
}

}  // namespace pyloader
