#include "core/safetensors_index.h"

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <map>
#include <stdexcept>

#include "core/checked.h"
#include "core/errors.h"
#include "core/file.h"
#include "core/json.h"

namespace fs = std::filesystem;

namespace pyloader {

namespace {

constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kIndexFile = "model.safetensors.index.json";

struct DTypeRow {
  DType dtype;
  const char* name;
  unsigned bits;
};

constexpr DTypeRow kDTypes[] = {
    {DType::BOOL, "BOOL", 8},       {DType::U8, "U8", 8},
    {DType::I8, "I8", 8},           {DType::F8_E4M3, "F8_E4M3", 8},
    {DType::F8_E5M2, "F8_E5M2", 8}, {DType::F8_E8M0, "F8_E8M0", 8},
    {DType::I16, "I16", 16},        {DType::U16, "U16", 16},
    {DType::F16, "F16", 16},        {DType::BF16, "BF16", 16},
    {DType::I32, "I32", 32},        {DType::U32, "U32", 32},
    {DType::F32, "F32", 32},        {DType::F64, "F64", 64},
    {DType::I64, "I64", 64},        {DType::U64, "U64", 64},
    {DType::C64, "C64", 64},        {DType::F4, "F4", 4},
    {DType::F8_E4M3FNUZ, "F8_E4M3FNUZ", 8}, {DType::F8_E5M2FNUZ, "F8_E5M2FNUZ", 8},
    {DType::F6_E2M3, "F6_E2M3", 6}, {DType::F6_E3M2, "F6_E3M2", 6},
};

const DTypeRow* find_dtype(const std::string& name) {
  for (const auto& row : kDTypes)
    if (name == row.name) return &row;
  return nullptr;
}

std::string shape_str(const std::vector<uint64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

struct Entry {
  TensorInfo info;
  uint64_t begin = 0, end = 0;  // relative to the data section
};

Entry parse_entry(const std::string& path, const std::string& name,
                  const json::Value& v) {
  auto bad = [&](const std::string& rule) -> FormatError {
    return FormatError(path, name, rule);
  };
  if (v.kind != json::Value::Kind::Object)
    throw bad(std::string("tensor entry must be a JSON object, got ") + v.kind_name());
  for (const auto& [key, _] : v.members)
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      throw bad("unexpected field '" + key +
                "' (a tensor entry has only dtype, shape and data_offsets)");
  Entry e;
  e.info.name = name;

  const json::Value* dt = v.find("dtype");
  if (!dt) throw bad("missing field 'dtype'");
  if (dt->kind != json::Value::Kind::String)
    throw bad(std::string("'dtype' must be a string, got ") + dt->kind_name());
  const DTypeRow* row = find_dtype(dt->text);
  if (!row) throw bad("unknown dtype '" + dt->text + "'");
  e.info.dtype = row->dtype;

  const json::Value* sh = v.find("shape");
  if (!sh) throw bad("missing field 'shape'");
  if (sh->kind != json::Value::Kind::Array)
    throw bad(std::string("'shape' must be an array, got ") + sh->kind_name());
  for (const auto& d : sh->items) {
    if (d.kind != json::Value::Kind::Number || !d.is_uint)
      throw bad("'shape' must hold non-negative integers, got " +
                (d.kind == json::Value::Kind::Number ? d.text : std::string(d.kind_name())));
    e.info.shape.push_back(d.uint);
  }

  const json::Value* off = v.find("data_offsets");
  if (!off) throw bad("missing field 'data_offsets'");
  if (off->kind != json::Value::Kind::Array || off->items.size() != 2)
    throw bad("'data_offsets' must be an array [begin, end]");
  for (const auto& d : off->items)
    if (d.kind != json::Value::Kind::Number || !d.is_uint)
      throw bad("'data_offsets' must hold non-negative integers, got " +
                (d.kind == json::Value::Kind::Number ? d.text : std::string(d.kind_name())));
  e.begin = off->items[0].uint;
  e.end = off->items[1].uint;
  if (e.end < e.begin)
    throw bad("data_offsets end " + std::to_string(e.end) + " is before begin " +
              std::to_string(e.begin));

  uint64_t elements = 1;
  for (uint64_t d : e.info.shape) {
    auto m = checked_mul(elements, d);
    if (!m) throw bad("element count of shape " + shape_str(e.info.shape) + " overflows 64 bits");
    elements = *m;
  }
  auto bits = checked_mul(elements, row->bits);
  if (!bits) throw bad("bit size of shape " + shape_str(e.info.shape) + " overflows 64 bits");
  if (*bits % 8 != 0)
    throw bad("size of " + std::to_string(elements) + " " + row->name +
              " elements is not a whole number of bytes");
  uint64_t nbytes = *bits / 8;
  if (nbytes != e.end - e.begin)
    throw bad("data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
              "] span " + std::to_string(e.end - e.begin) + " bytes but " + row->name +
              " with shape " + shape_str(e.info.shape) + " needs " + std::to_string(nbytes));
  e.info.nbytes = nbytes;
  return e;
}

}  // namespace

const char* dtype_name(DType d) {
  for (const auto& row : kDTypes)
    if (row.dtype == d) return row.name;
  return "?";
}

unsigned dtype_bits(DType d) {
  for (const auto& row : kDTypes)
    if (row.dtype == d) return row.bits;
  return 0;
}

unsigned dtype_alignment(DType d) {
  unsigned bits = dtype_bits(d);
  if (d == DType::C64) return 4;  // two float32 components
  return bits >= 8 ? bits / 8 : 1;
}

FileInfo TensorIndex::parse_file(const std::string& path, uint32_t file_id,
                                 std::vector<TensorInfo>& out) {
  File f = File::open_read(path);
  FileInfo fi;
  fi.path = path;
  fi.identity = f.identity();
  fi.size = fi.identity.size;
  auto bad = [&](const std::string& rule) -> FormatError {
    return FormatError(path, rule);
  };

  // Rule 1: the 8-byte little-endian header length.
  if (fi.size < 8)
    throw bad("file is " + std::to_string(fi.size) +
              " bytes, too small for the 8-byte header length");
  // Read exactly the header: readahead would also bring in the first tensors
  // (tens of KiB), which a caller reading only some tensors (one pipeline
  // rank's layers) never asked for. Advisory.
  f.advise(0, 0, Advice::Random);
  unsigned char len_bytes[8];
  f.read_exact(len_bytes, 8, 0);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  // Rule 2: bounded header.
  if (n > kMaxHeaderBytes)
    throw bad("header length " + std::to_string(n) + " exceeds the limit of " +
              std::to_string(kMaxHeaderBytes) + " bytes");
  // Rule 3: the header lies inside the file.
  auto header_end = checked_add(8, n);
  if (!header_end || *header_end > fi.size)
    throw bad("header length " + std::to_string(n) + " runs past the end of the " +
              std::to_string(fi.size) + "-byte file (incomplete download?)");
  fi.header_bytes = n;
  fi.data_start = *header_end;

  // Rule 4: UTF-8 JSON object, surrounding whitespace allowed.
  std::string header(n, '\0');
  if (n) f.read_exact(header.data(), n, 8);
  if (!json::valid_utf8(header)) throw bad("header is not valid UTF-8");
  json::Value root;
  try {
    root = json::parse(header);
  } catch (const json::ParseError& e) {
    throw bad(std::string("header is not valid JSON: ") + e.what());
  }
  if (root.kind != json::Value::Kind::Object)
    throw bad(std::string("header must be a JSON object, got ") + root.kind_name());

  // Rules 5-8: metadata and tensor entries (duplicates rejected by the parser).
  std::vector<Entry> entries;
  for (const auto& [key, value] : root.members) {
    if (key == "__metadata__") {
      // null is "no metadata" (MLX writes it; safetensors reads it as None).
      if (value.kind == json::Value::Kind::Null) continue;
      if (value.kind != json::Value::Kind::Object)
        throw bad(std::string("__metadata__ must be an object, got ") + value.kind_name());
      for (const auto& [mk, mv] : value.members) {
        if (mv.kind != json::Value::Kind::String)
          throw bad("__metadata__ value of '" + mk + "' must be a string, got " +
                    mv.kind_name());
        fi.metadata.emplace_back(mk, mv.text);
      }
      continue;
    }
    entries.push_back(parse_entry(path, key, value));
  }

  // Rule 7: sorted by offset, contiguous from 0, no holes, no overlap.
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  std::string prev;
  for (const auto& e : entries) {
    if (e.begin != expected) {
      std::string where = prev.empty() ? "the data section starts at 0"
                                       : "the previous tensor '" + prev + "' ends at " +
                                             std::to_string(expected);
      throw FormatError(path, e.info.name,
                        std::string(e.begin > expected ? "hole" : "overlap") +
                            " in the data section: tensor begins at " +
                            std::to_string(e.begin) + " but " + where);
    }
    expected = e.end;
    prev = e.info.name;
  }
  // Rule 9: the data section ends exactly at the end of the file.
  auto data_end = checked_add(fi.data_start, expected);
  if (!data_end || *data_end != fi.size)
    throw bad("tensor data ends at byte " +
              (data_end ? std::to_string(*data_end) : std::string("(overflow)")) +
              " but the file has " + std::to_string(fi.size) + " bytes (" +
              (data_end && *data_end < fi.size ? "trailing bytes" : "truncated file") + ")");

  for (auto& e : entries) {
    e.info.file = file_id;
    e.info.offset = fi.data_start + e.begin;  // cannot overflow: checked above
    e.info.aligned = e.info.offset % dtype_alignment(e.info.dtype) == 0;
    out.push_back(std::move(e.info));
  }
  return fi;
}

void TensorIndex::add_file(const std::string& path) {
  std::vector<TensorInfo> found;
  files_.push_back(parse_file(path, static_cast<uint32_t>(files_.size()), found));
  for (auto& t : found) {
    auto [it, inserted] = by_name_.emplace(t.name, tensors_.size());
    if (!inserted)
      throw FormatError(path, t.name,
                        "tensor name also present in " +
                            files_[tensors_[it->second].file].path);
    total_nbytes_ += t.nbytes;
    tensors_.push_back(std::move(t));
  }
}

const TensorInfo* TensorIndex::find(const std::string& name) const {
  if (auto it = by_name_.find(name); it != by_name_.end()) return &tensors_[it->second];
  auto it = slice_by_name_.find(name);
  return it == slice_by_name_.end() ? nullptr : &slices_[it->second];
}

std::vector<Extent> extents_of(const TensorInfo& t) {
  if (!t.extents.empty()) return t.extents;
  return {Extent{t.offset, t.nbytes}};
}

namespace {

// The slice `s` of checkpoint tensor `t` (see TensorIndex::with_slices).
TensorInfo cut(const TensorInfo& t, const TensorSlice& s, const std::string& file) {
  auto fail = [&](const std::string& why) {
    return std::invalid_argument("[TensorIndex::with_slices] " + file + ": slice '" +
                                 printable_name(s.name) + "' of tensor '" +
                                 printable_name(t.name) + "': " + why);
  };
  const unsigned bits = dtype_bits(t.dtype);
  if (bits % 8) throw fail(std::string("dtype ") + dtype_name(t.dtype) + " is sub-byte");
  if (s.axis >= t.shape.size())
    throw fail("axis " + std::to_string(s.axis) + " of a " + std::to_string(t.shape.size()) +
               "-d tensor");
  if (s.ranges.empty()) throw fail("no range");
  if (t.nbytes == 0) throw fail("the tensor is empty");
  // Bytes of one index along the axis, and how many times the axis repeats.
  // The tensor's own entry was checked (elements x itemsize == nbytes), so
  // these products cannot overflow.
  uint64_t inner = bits / 8, outer = 1;
  for (size_t d = s.axis + 1; d < t.shape.size(); ++d) inner *= t.shape[d];
  for (size_t d = 0; d < s.axis; ++d) outer *= t.shape[d];
  const uint64_t dim = t.shape[s.axis];
  uint64_t kept = 0;
  for (const auto& [start, stop] : s.ranges) {
    if (!(start < stop && stop <= dim))
      throw fail("range [" + std::to_string(start) + ", " + std::to_string(stop) +
                 ") along axis " + std::to_string(s.axis) + " of length " +
                 std::to_string(dim));
    kept += stop - start;
  }
  TensorInfo out;
  out.name = s.name;
  out.file = t.file;
  out.dtype = t.dtype;
  out.shape = t.shape;
  out.shape[s.axis] = kept;
  for (uint64_t o = 0; o < outer; ++o)
    for (const auto& [start, stop] : s.ranges) {
      Extent e{t.offset + (o * dim + start) * inner, (stop - start) * inner};
      if (!out.extents.empty() &&
          out.extents.back().offset + out.extents.back().len == e.offset)
        out.extents.back().len += e.len;  // adjacent: one range
      else
        out.extents.push_back(e);
    }
  out.offset = out.extents.front().offset;
  for (const Extent& e : out.extents) out.nbytes += e.len;
  if (out.extents.size() == 1) {
    out.extents.clear();
    out.aligned = out.offset % dtype_alignment(out.dtype) == 0;
  } else {
    out.aligned = false;  // never one view
  }
  return out;
}

}  // namespace

TensorIndex TensorIndex::with_slices(const std::vector<TensorSlice>& slices) const {
  TensorIndex out = *this;
  out.slices_.reserve(out.slices_.size() + slices.size());
  for (const TensorSlice& s : slices) {
    const TensorInfo& t = at(s.tensor);
    if (out.find(s.name))
      throw std::invalid_argument("[TensorIndex::with_slices] " + files_[t.file].path +
                                  ": slice '" + printable_name(s.name) + "' of tensor '" +
                                  printable_name(t.name) + "': the name is already taken");
    out.slices_.push_back(cut(t, s, files_[t.file].path));
    out.slice_by_name_.emplace(s.name, out.slices_.size() - 1);
  }
  return out;
}

const TensorInfo& TensorIndex::at(const std::string& name) const {
  const TensorInfo* t = find(name);
  if (!t) throw TensorNotFound("no tensor named '" + printable_name(name) + "' in " + root_);
  return *t;
}

TensorIndex TensorIndex::of_regions(const std::string& path, uint64_t data_start,
                                    const std::vector<TensorRegion>& regions) {
  TensorIndex idx;
  idx.root_ = path;
  File f = File::open_read(path);
  FileInfo fi;
  fi.path = path;
  fi.identity = f.identity();
  fi.size = fi.identity.size;
  if (data_start > fi.size)
    throw FormatError(path, "data starts at byte " + std::to_string(data_start) +
                                " past the end of the " + std::to_string(fi.size) +
                                "-byte file");
  fi.header_bytes = data_start;
  fi.data_start = data_start;
  idx.files_.push_back(std::move(fi));
  const uint64_t size = idx.files_[0].size;
  for (const TensorRegion& r : regions) {
    auto bad = [&](const std::string& rule) { return FormatError(path, r.name, rule); };
    const DTypeRow* row = find_dtype(r.dtype);
    if (!row || row->bits % 8) throw bad("dtype '" + r.dtype + "' is not a whole-byte dtype");
    std::optional<uint64_t> bytes = row->bits / 8;
    for (uint64_t d : r.shape)
      if (bytes) bytes = checked_mul(*bytes, d);
    if (!bytes || *bytes != r.nbytes)
      throw bad("shape " + shape_str(r.shape) + " of " + r.dtype + " is not " +
                std::to_string(r.nbytes) + " bytes");
    auto end = checked_add(r.offset, r.nbytes);
    if (r.offset < data_start || !end || *end > size)
      throw bad("bytes [" + std::to_string(r.offset) + ", +" + std::to_string(r.nbytes) +
                ") are not inside the data section [" + std::to_string(data_start) + ", " +
                std::to_string(size) + ")");
    TensorInfo t;
    t.name = r.name;
    t.file = 0;
    t.dtype = row->dtype;
    t.shape = r.shape;
    t.offset = r.offset;
    t.nbytes = r.nbytes;
    t.aligned = t.offset % dtype_alignment(t.dtype) == 0;
    auto [it, inserted] = idx.by_name_.emplace(t.name, idx.tensors_.size());
    if (!inserted) throw bad("two regions have this name");
    idx.total_nbytes_ += t.nbytes;
    idx.tensors_.push_back(std::move(t));
  }
  return idx;
}

TensorIndex TensorIndex::open(const std::string& path) {
  TensorIndex idx;
  idx.root_ = path;
  std::error_code ec;
  auto st = fs::status(path, ec);
  if (ec || !fs::exists(st)) {
    if (describe_path(path).err == ENOENT && !fs::is_symlink(fs::symlink_status(path, ec)))
      throw IoError("stat", path, ENOENT);
    regular_file_identity(path);  // throws, saying what the path is
  }

  if (!fs::is_directory(st)) {
    idx.add_file(path);
    return idx;
  }

  fs::path dir(path);
  fs::path index_path = dir / kIndexFile;
  // An index that is there in any form (a link to nothing, a loop) is the index:
  // reading the directory's shards instead would ignore what it says.
  if (fs::exists(fs::symlink_status(index_path, ec))) {
    const std::string ip = index_path.string();
    File f = File::open_read(ip);
    if (f.size() > kMaxHeaderBytes)
      throw FormatError(ip, "index file is larger than " +
                                    std::to_string(kMaxHeaderBytes) + " bytes");
    std::string text(f.size(), '\0');
    if (!text.empty()) f.read_exact(text.data(), text.size(), 0);
    if (!json::valid_utf8(text)) throw FormatError(ip, "index is not valid UTF-8");
    json::Value root;
    try {
      root = json::parse(text);
    } catch (const json::ParseError& e) {
      throw FormatError(ip, std::string("index is not valid JSON: ") + e.what());
    }
    if (root.kind != json::Value::Kind::Object)
      throw FormatError(ip, "index must be a JSON object");
    if (const json::Value* meta = root.find("metadata");
        meta && meta->kind == json::Value::Kind::Object) {
      for (const auto& [k, v] : meta->members)
        idx.index_metadata_.emplace_back(k, v.text);  // strings and numbers
    }
    const json::Value* wm = root.find("weight_map");
    if (!wm || wm->kind != json::Value::Kind::Object)
      throw FormatError(ip, "index has no 'weight_map' object");
    // Each weight_map value names a shard; "s1.safetensors", "./s1.safetensors" and a
    // link to it are one file: shards are keyed by (device, inode).
    std::vector<std::string> shards;                // normalized names, sorted below
    std::map<std::string, std::string> normalized;  // weight_map value -> normalized
    for (const auto& [name, file] : wm->members) {
      if (file.kind != json::Value::Kind::String)
        throw FormatError(ip, name, "weight_map value must be a file name string");
      if (file.text.find('\0') != std::string::npos)
        throw FormatError(ip, name, "weight_map file name contains a NUL byte");
      fs::path rel(file.text);
      bool escapes = rel.empty() || rel.is_absolute();
      for (const auto& part : rel)
        if (part == "..") escapes = true;
      if (escapes)
        throw FormatError(ip, name, "weight_map file '" + file.text +
                                        "' is not a relative path inside the model directory");
      std::string norm = rel.lexically_normal().string();
      normalized.emplace(file.text, norm);
      if (std::find(shards.begin(), shards.end(), norm) == shards.end()) shards.push_back(norm);
    }
    std::sort(shards.begin(), shards.end());
    std::map<std::string, uint32_t> file_of;  // normalized name -> file id
    for (const auto& s : shards) {
      std::string p = (dir / s).string();
      FileIdentity id = regular_file_identity(p);
      const FileInfo* same = nullptr;
      for (const FileInfo& f : idx.files_)
        if (f.identity.dev == id.dev && f.identity.ino == id.ino) same = &f;
      if (same) {
        file_of[s] = static_cast<uint32_t>(same - idx.files_.data());
        continue;
      }
      file_of[s] = static_cast<uint32_t>(idx.files_.size());
      idx.add_file(p);
    }
    // The index and the shards must agree both ways.
    for (const auto& [name, file] : wm->members) {
      const TensorInfo* t = idx.find(name);
      if (!t)
        throw FormatError(ip, name, "weight_map names this tensor in '" + file.text +
                                        "' but that file does not contain it");
      if (t->file != file_of.at(normalized.at(file.text)))
        throw FormatError(ip, name, "weight_map names this tensor in '" + file.text +
                                        "' but it is stored in " + idx.files_[t->file].path);
    }
    if (idx.tensors_.size() != wm->members.size()) {
      for (const auto& t : idx.tensors_)
        if (!wm->find(t.name))
          throw FormatError(idx.files_[t.file].path, t.name,
                            "tensor is stored in a shard but missing from " + ip);
    }
    return idx;
  }

  std::vector<std::string> found;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    // A *.safetensors that is not a regular file (a link to a missing blob, a
    // directory, a device) is an error naming it, not a file silently left out.
    if (entry.path().extension() == ".safetensors") found.push_back(entry.path().string());
  }
  if (ec) throw IoError("readdir", path, ec.value());
  if (found.empty()) throw IoError("find *.safetensors in directory", path, ENOENT);
  std::sort(found.begin(), found.end());
  std::vector<FileIdentity> ids;
  for (const auto& p : found) {
    FileIdentity id = regular_file_identity(p);
    bool seen = false;
    for (const FileIdentity& o : ids) seen = seen || (o.dev == id.dev && o.ino == id.ino);
    if (seen) continue;  // the same file under a second name (a link): one shard
    ids.push_back(id);
    idx.add_file(p);
  }
  return idx;
}

}  // namespace pyloader
