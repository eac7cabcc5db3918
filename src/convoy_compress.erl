%% @private
%% Compressed batches (protocol version 4, kind `zbatch'), pure: whether a lane
%% ships a batch compressed, its encoding, and its decoding on the receiver.
%%
%% A lane sends `{'$convoy', 1, zbatch, FromNode, Bin}' (`convoy_wire:zbatch/2'),
%% `Bin' being `term_to_binary(Entries, [{compressed, Level}])' of exactly the
%% entries the plain batch would carry, only when all of these hold
%% (`envelope/5'):
%% <ul>
%% <li>the lane asks for a zlib level (1..9), not `never': the `compress'
%%   setting's, or under `auto' the one a busy batch's meter gives
%%   (`convoy_compress_auto');</li>
%% <li>the peer's negotiated version reads it (`convoy_wire:supports(Vsn,
%%   zbatch)'): a peer below version 4 always gets plain batches;</li>
%% <li>the batch carries at least `MIN_MESSAGES' messages and their encoded size,
%%   as senders measured it for the node's bound (`convoy_size:bytes/1'), is at
%%   least `MIN_BYTES';</li>
%% <li>the compressed binary is smaller than that size.</li>
%% </ul>
%% Otherwise the plain batch goes. Only a lane's batches of small messages are
%% ever compressed (their multicast and publish entries too): large messages
%% travel alone and pieces from their sender, both untouched.
%%
%% The receiving inbox decodes `Bin' with `decode/1' and hands the entries to the
%% same path as a plain batch's, so a compressed batch is delivered exactly as the
%% batch it encodes, in arrival order with the inbox's other batches. It trusts
%% `Bin' as distribution trusts what it decodes (no `safe': the peer is a
%% connected node, which may create atoms here anyway); a `Bin' that does not
%% decode, or decodes to anything but a proper list, is refused whole and
%% counted `bad_compressed' by the inbox.
-module(convoy_compress).

-export([envelope/5, shipped/5, level/4, encode/2, decode/1, min_bytes/0]).

-export_type([envelope/0]).

%% The fewest bytes (the messages' encoded size) a batch needs to be compressed.
%% Below about 1 KiB a batch fits in one Ethernet frame (1,500-byte MTU) plain,
%% so compressing it saves no packet on the wire, while every call pays zlib's
%% fixed cost (its stream state set up and torn down) and the receiver a second
%% decoding pass (doc/decisions.md, "Batches are compressed only at an explicit
%% level").
-define(MIN_BYTES, 1024).
%% A batch of one message is a message that happens to travel alone: the path a
%% single message takes stays as cheap as plain, whatever its size.
-define(MIN_MESSAGES, 2).

%% What a lane ships: the plain batch, or the compressed one with its size.
-type envelope() :: {batch, tuple()} | {zbatch, tuple(), BytesOut :: pos_integer()}.

%% @doc The fewest bytes a batch needs to be compressed (`MIN_BYTES').
-spec min_bytes() -> pos_integer().
min_bytes() -> ?MIN_BYTES.

%% @doc The envelope a lane ships `Entries' in, from `FromNode' to a peer at
%% negotiated version `Vsn', under the `compress' setting `Compress'; `Msgs' is
%% the number of messages among the entries and `Bytes' their encoded size.
-spec envelope(node(), [convoy_wire:entry()],
               {Msgs :: non_neg_integer(), Bytes :: non_neg_integer()},
               convoy_config:compress(), pos_integer()) -> envelope().
envelope(FromNode, Entries, {Msgs, Bytes}, Compress, Vsn) ->
    case level(Compress, Vsn, Msgs, Bytes) of
        none -> {batch, convoy_wire:batch(FromNode, Entries)};
        Level -> smaller(FromNode, Entries, encode(Entries, Level), Bytes)
    end.

%% @doc `envelope/5' as a lane ships it: the term to send, and what to count for
%% it (`plain', or its messages, their bytes and the compressed size).
-spec shipped(node(), [convoy_wire:entry()],
              {Msgs :: non_neg_integer(), Bytes :: non_neg_integer()},
              convoy_config:compress(), pos_integer()) ->
          {tuple(), plain | {non_neg_integer(), non_neg_integer(), pos_integer()}}.
shipped(FromNode, Entries, {Msgs, Bytes} = Size, Compress, Vsn) ->
    case envelope(FromNode, Entries, Size, Compress, Vsn) of
        {batch, Batch} -> {Batch, plain};
        {zbatch, ZBatch, Out} -> {ZBatch, {Msgs, Bytes, Out}}
    end.

%% @doc The zlib level to try on a batch of `Msgs' messages of `Bytes' to a peer
%% at version `Vsn' under the setting `Compress', or `none': plain.
-spec level(convoy_config:compress(), pos_integer(), non_neg_integer(), non_neg_integer()) ->
          none | 1..9.
level(never, _Vsn, _Msgs, _Bytes) ->
    none;
level(Level, Vsn, Msgs, Bytes) ->
    case Msgs >= ?MIN_MESSAGES andalso Bytes >= ?MIN_BYTES
        andalso convoy_wire:supports(Vsn, zbatch) of
        true -> Level;
        false -> none
    end.

%% The compressed batch only when it is smaller than the plain messages' bytes:
%% otherwise compressing bought nothing and the receiver would decode twice.
smaller(FromNode, _Entries, Bin, Bytes) when byte_size(Bin) < Bytes ->
    {zbatch, convoy_wire:zbatch(FromNode, Bin), byte_size(Bin)};
smaller(FromNode, Entries, _Bin, _Bytes) ->
    {batch, convoy_wire:batch(FromNode, Entries)}.

%% @doc A batch's entries, compressed at zlib level `Level'.
-spec encode([convoy_wire:entry()], 1..9) -> binary().
encode(Entries, Level) ->
    term_to_binary(Entries, [{compressed, Level}]).

%% @doc The entries a compressed batch's payload encodes, or `error' when it is
%% not a binary, does not decode, or decodes to anything but a proper list.
-spec decode(term()) -> {ok, list()} | error.
decode(Bin) when is_binary(Bin) ->
    try
        proper(binary_to_term(Bin))
    catch
        error:badarg -> error % not the external format, or a corrupt zlib stream
    end;
decode(_NotBinary) ->
    error.

%% A list's length is read in C, and raises badarg on an improper list.
proper(Entries) when is_list(Entries) ->
    _ = length(Entries),
    {ok, Entries};
proper(_NotList) ->
    error.

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

%% Event-shaped messages to a pid, as a lane's batch carries them.
events(N) ->
    [{self(), {event, I, <<"user-42">>, #{k => I, body => binary:copy(<<"abc">>, 100)}}}
     || I <- lists:seq(1, N)].

bytes(Entries) ->
    lists:sum([erlang:external_size(Msg) || {_To, Msg} <- Entries]).

roundtrip_test() ->
    Es = events(50) ++ [{[self(), foo], m}, {'$convoy_publish', pg, {room, 1}, hi},
                        {'$convoy_barrier', self(), make_ref()}, {alias(), <<0:8000>>}],
    [?assertEqual({ok, Es}, decode(encode(Es, L))) || L <- lists:seq(1, 9)],
    ?assertEqual({ok, []}, decode(encode([], 6))).

zbatch_when_it_pays_test() ->
    Es = events(20),
    B = bytes(Es),
    ?assert(B >= ?MIN_BYTES),
    {zbatch, {'$convoy', 1, zbatch, a@h, Bin}, Out} = envelope(a@h, Es, {20, B}, 6, 4),
    ?assertEqual(byte_size(Bin), Out),
    ?assert(Out < B),
    ?assertEqual({ok, Es}, decode(Bin)),
    %% every level is a zlib stream the receiver reads
    [?assertMatch({zbatch, _, _}, envelope(a@h, Es, {20, B}, L, 4)) || L <- lists:seq(1, 9)].

plain_otherwise_test() ->
    Es = events(20),
    B = bytes(Es),
    Plain = {batch, convoy_wire:batch(a@h, Es)},
    ?assertEqual(Plain, envelope(a@h, Es, {20, B}, never, 4)),
    %% a peer below version 4 never gets one
    [?assertEqual(Plain, envelope(a@h, Es, {20, B}, 6, V)) || V <- [1, 2, 3]],
    %% below the minimum, or one message
    ?assertEqual(Plain, envelope(a@h, Es, {20, ?MIN_BYTES - 1}, 6, 4)),
    One = events(1),
    ?assertEqual({batch, convoy_wire:batch(a@h, One)},
                 envelope(a@h, One, {1, 5 * ?MIN_BYTES}, 6, 4)),
    %% not smaller than the plain bytes: random bytes do not compress
    Noise = [{self(), rand:bytes(400)} || _ <- lists:seq(1, 4)],
    ?assertEqual({batch, convoy_wire:batch(a@h, Noise)},
                 envelope(a@h, Noise, {4, bytes(Noise)}, 9, 4)).

level_test() ->
    ?assertEqual(none, level(never, 4, 100, 100000)),
    ?assertEqual(1, level(1, 4, 2, ?MIN_BYTES)),
    ?assertEqual(9, level(9, 5, 2, ?MIN_BYTES)),
    ?assertEqual(none, level(9, 4, 1, ?MIN_BYTES)),
    ?assertEqual(none, level(9, 4, 2, ?MIN_BYTES - 1)),
    ?assertEqual(none, level(9, 3, 2, ?MIN_BYTES)).

%% A higher level never does worse than a lower one on such repetitive data.
levels_test() ->
    Es = events(200),
    Sizes = [byte_size(encode(Es, L)) || L <- [1, 6, 9]],
    ?assertEqual(lists:reverse(lists:sort(Sizes)), Sizes),
    ?assert(lists:last(Sizes) < bytes(Es) div 4).

decode_rejects_test() ->
    ?assertEqual(error, decode(<<"not zlib">>)),
    ?assertEqual(error, decode(<<131, 80, 0, 0, 0, 10, "not zlib">>)),
    ?assertEqual(error, decode(term_to_binary({not_a, list}, [compressed]))),
    ?assertEqual(error, decode(term_to_binary([a | b], [compressed]))),
    ?assertEqual(error, decode([a])),
    ?assertEqual(error, decode(<<>>)).
-endif.
