%% @private
%% What convoy holds for one node now, and the only module that touches it.
%%
%% Each node row (`convoy_peers' creates it) has an `atomics' array with one slot,
%% a single word read and changed as a whole:
%% <pre>
%%   bit 63      bit 62    bits 61..36            bits 35..0
%%   sign (0)    closed    messages (26 bits)     bytes (36 bits)
%% </pre>
%% messages handed to a lane for that node and not yet shipped or dropped, and
%% their encoded bytes (`convoy_size`). Senders take room (`hold/4') before handing a message
%% to a lane, within the node's bounds (`max_buffered', `max_buffered_bytes');
%% the lane gives it back as messages leave (`release/3'). Lane mailboxes are
%% included, so the bounds hold whatever the lane is doing.
%%
%% Taking room (`hold/4', `hold_many/5') is one read (`owned/1') and one
%% `compare_exchange' from what was read to that plus one message and its bytes:
%% one read-modify-write when no other sender changed the word in between (a
%% sender that lost the race decides again from the value the exchange
%% returned). Such a hold that does not fit writes nothing. A flood's sender
%% (`hold_behind/4') adds first and gives back what it did not take: for that
%% moment the word counts one message more than was granted, which can only make
%% another sender find no room; room is never granted past the bounds. Release is
%% one `add' of minus both fields at once.
%%
%% Ceiling: each field has a fixed width, so whatever the configured bounds
%% (`infinity' included) at most 67,108,863 messages (2^26 - 1) and
%% 68,719,476,735 bytes (2^36 - 1, 64 GiB - 1) are held for one node at
%% a time; a hold past either answers `full', and the overload policy applies as
%% for the configured bounds. The rule that a message alone may exceed the byte
%% bound does not extend past the field: one message of 64 GiB or more
%% never fits.
%%
%% Which bounds apply to a message is `convoy_path:held_bytes/4''s: `hold/3' and
%% `has_room/3' take them from the settings in force, for every caller alike (a
%% sender taking room, its wait, the lane deciding whether to wake it).
%%
%% Forgetting a row (`convoy_peers', only for a node that is not connected and
%% holds nothing): `try_close/1' sets the closed bit with a `compare_exchange'
%% from exactly 0 (nothing held, not closed), so it fails if anything is held and
%% a hold fails once it succeeded: a sender that reads the bit gets `closed' and
%% must fetch the node's references again. A closed array stays closed and reads
%% as holding nothing; a holder of cached references learns it from `hold/4'
%% (`closed') and fetches them again. Only what was held is ever released, so a
%% closed array is never released.
%%
%% Also here, each node's shares of the bound on its partial messages in pieces
%% (`convoy_chunk_bound' keeps the rows and says how inboxes use them): an
%% `atomics' array with one slot per inbox, the bytes that inbox's partials of
%% the node reserve, and a last slot, the mark of a row being forgotten.
-module(convoy_held).

-export([new/0, hold/3, hold/4, hold_behind/4, hold_many/5, release/3, has_room/3, has_room/4,
         read/1, is_empty/1, is_closed/1, try_close/1]).
-export([new_shares/1, others_share/2, claim_share/5, set_share/3, shares/1, try_close_shares/1]).

-include("convoy_runtime.hrl").

-ifdef(TEST).
-export([ceiling/0, set/3]).
-endif.

-export_type([held/0, bound/0, shares/0]).

%% A flood's every send takes its room through them.
-compile({inline, [fits/5, within/2]}).

-opaque held() :: atomics:atomics_ref().
-opaque shares() :: atomics:atomics_ref().
-type bound() :: pos_integer() | infinity.

-define(SLOT, 1).
-define(BYTE_BITS, 36).
-define(MSG_BITS, 26).
-define(MAX_BYTES, ((1 bsl ?BYTE_BITS) - 1)).
-define(MAX_MSGS, ((1 bsl ?MSG_BITS) - 1)).
%% One message, in the word.
-define(MSG, (1 bsl ?BYTE_BITS)).
-define(CLOSED_BIT, (1 bsl (?BYTE_BITS + ?MSG_BITS))).
%% Whether a word has the closed bit: by a shift, as the bit is past the range
%% of small integers (a comparison with it would be one with a bignum).
-define(IS_CLOSED(W), (((W) bsr (?BYTE_BITS + ?MSG_BITS)) =/= 0)).

-define(MSGS(W), ((W) bsr ?BYTE_BITS)).
-define(BYTES(W), ((W) band ?MAX_BYTES)).

-spec new() -> held().
new() -> atomics:new(1, [{signed, true}]).

%% @doc `hold/4' within the bounds the settings `RT' set for a message of `Bytes'
%% (`convoy_path:held_bytes/4').
-spec hold(held(), non_neg_integer(), #runtime{}) -> ok | full | closed.
hold(H, Bytes, RT = #runtime{max_buffered = MaxN}) ->
    hold(H, Bytes, MaxN, max_bytes(Bytes, RT)).

%% @doc `has_room/4' within the bounds the settings `RT' set for a message of
%% `Bytes', as `hold/3' takes it.
-spec has_room(held(), non_neg_integer(), #runtime{}) -> boolean().
has_room(H, Bytes, RT = #runtime{max_buffered = MaxN}) ->
    has_room(H, Bytes, MaxN, max_bytes(Bytes, RT)).

%% The runtime's busy limit is read only for a large message, and applies only
%% where its sender may wait for room (`overload' `block', as `!' waits for a
%% busy connection): under `drop' and `error' the node's bound is the user's
%% `max_buffered_bytes' alone, so a large message is never refused sooner than
%% the setting says.
max_bytes(Bytes, #runtime{overload = block, large_threshold = T, max_buffered_bytes = MaxB})
  when T =/= infinity, Bytes >= T ->
    convoy_path:held_bytes(Bytes, T, MaxB, erlang:system_info(dist_buf_busy_limit));
max_bytes(_Bytes, #runtime{max_buffered_bytes = MaxB}) ->
    MaxB.

%% @doc Take room for one message of `Bytes' within the bounds: `full' (nothing
%% taken) when it does not fit, `closed' when the row was forgotten.
-spec hold(held(), non_neg_integer(), bound(), bound()) -> ok | full | closed.
hold(H, Bytes, MaxN, MaxB) ->
    hold(H, owned(H), Bytes, MaxN, MaxB).

hold(_H, W, _Bytes, _MaxN, _MaxB) when ?IS_CLOSED(W) ->
    closed;
hold(H, W, Bytes, MaxN, MaxB) ->
    case fits(?MSGS(W), ?BYTES(W), Bytes, MaxN, MaxB) of
        true ->
            case atomics:compare_exchange(H, ?SLOT, W, W + ?MSG + Bytes) of
                ok -> ok;
                Now -> hold(H, Now, Bytes, MaxN, MaxB)
            end;
        false ->
            full
    end.

%% @doc `hold/4' only while messages are held already (a lane has the node's
%% traffic in hand): `empty' (nothing taken) when none is held. One atomic
%% operation serves both in a flood: the room is added first and given back when
%% the word before it held nothing, was closed, or had no room for it. Between
%% the two, another sender may find the node holding one message more than it
%% does: it may then answer `full' a moment early, never take room past the
%% bound.
-spec hold_behind(held(), non_neg_integer(), bound(), bound()) -> ok | full | closed | empty.
hold_behind(H, Bytes, MaxN, MaxB) ->
    Add = ?MSG + Bytes,
    case atomics:add_get(H, ?SLOT, Add) - Add of
        W when ?IS_CLOSED(W) -> give_back(H, Add, closed);
        W when ?MSGS(W) =:= 0 -> give_back(H, Add, empty);
        W ->
            case fits(?MSGS(W), ?BYTES(W), Bytes, MaxN, MaxB) of
                true -> ok;
                false -> give_back(H, Add, full)
            end
    end.

give_back(H, Add, Answer) ->
    atomics:add(H, ?SLOT, -Add),
    Answer.

%% @doc Take room for `K' messages of `Bytes' in all, all or none: `full' when
%% they do not all fit (as one by one, only a single message alone may exceed
%% the byte bound), `closed' when the row was forgotten.
-spec hold_many(held(), pos_integer(), non_neg_integer(), bound(), bound()) ->
          ok | full | closed.
hold_many(H, 1, Bytes, MaxN, MaxB) ->
    hold(H, Bytes, MaxN, MaxB);
hold_many(H, K, Bytes, MaxN, MaxB) ->
    hold_many(H, owned(H), K, Bytes, MaxN, MaxB).

hold_many(_H, W, _K, _Bytes, _MaxN, _MaxB) when ?IS_CLOSED(W) ->
    closed;
hold_many(H, W, K, Bytes, MaxN, MaxB) ->
    Held = ?MSGS(W),
    HeldBytes = ?BYTES(W),
    case Held + K =< ?MAX_MSGS andalso within(Held + K, MaxN)
        andalso HeldBytes + Bytes =< ?MAX_BYTES andalso within(HeldBytes + Bytes, MaxB) of
        true ->
            case atomics:compare_exchange(H, ?SLOT, W, W + K * ?MSG + Bytes) of
                ok -> ok;
                Now -> hold_many(H, Now, K, Bytes, MaxN, MaxB)
            end;
        false ->
            full
    end.

%% The word, read as the exchange that follows will write it: a
%% `compare_exchange' from a value the word never holds (its sign bit is never
%% set) changes nothing and returns the word, and takes its cache line for
%% writing, where a plain read would take it shared and the exchange would then
%% have to take it again: under senders on several cores, one transfer of the
%% line per hold instead of two.
owned(H) ->
    atomics:compare_exchange(H, ?SLOT, -1, -1).

%% @doc `K' held messages of `Bytes' in all left (shipped or dropped).
-spec release(held(), non_neg_integer(), non_neg_integer()) -> ok.
release(_H, 0, 0) ->
    ok;
release(H, K, Bytes) ->
    %% add/3 of the negation: sub/3 is add/3 behind a wrapper.
    atomics:add(H, ?SLOT, -(K * ?MSG + Bytes)).

%% @doc Whether a message of `Bytes' would fit now (a lane deciding whether to wake
%% a blocked sender; the sender still takes the room with `hold/4').
-spec has_room(held(), non_neg_integer(), bound(), bound()) -> boolean().
has_room(H, Bytes, MaxN, MaxB) ->
    {N, B} = read(H),
    fits(N, B, Bytes, MaxN, MaxB).

%% A message alone may exceed the byte bound, never the byte field.
fits(Held, HeldBytes, Bytes, MaxN, MaxB) ->
    Held < ?MAX_MSGS andalso within(Held + 1, MaxN)
        andalso HeldBytes + Bytes =< ?MAX_BYTES
        andalso (HeldBytes =< 0 orelse within(HeldBytes + Bytes, MaxB)).

within(_, infinity) -> true;
within(V, Max) -> V =< Max.

%% @doc Messages and bytes held now (a closed row holds nothing).
-spec read(held()) -> {integer(), integer()}.
read(H) ->
    case atomics:get(H, ?SLOT) of
        W when ?IS_CLOSED(W) -> {0, 0};
        W -> {?MSGS(W), ?BYTES(W)}
    end.

%% @doc Nothing held (and not closed).
-spec is_empty(held()) -> boolean().
is_empty(H) ->
    atomics:get(H, ?SLOT) =:= 0.

%% @doc Whether the row was forgotten (senders learn it from `hold/4'; a lane that
%% kept the row's references, when it accepts messages).
-spec is_closed(held()) -> boolean().
is_closed(H) ->
    ?IS_CLOSED(atomics:get(H, ?SLOT)).

%% @doc Close for good if nothing is held; otherwise leave it as it was.
-spec try_close(held()) -> boolean().
try_close(H) ->
    atomics:compare_exchange(H, ?SLOT, 0, ?CLOSED_BIT) =:= ok.

%%--------------------------------------------------------------------
%% Shares of the bound on partial messages

%% @doc A node's shares, for `Inboxes' inboxes: nothing reserved, not marked.
-spec new_shares(pos_integer()) -> shares().
new_shares(Inboxes) -> atomics:new(Inboxes + 1, [{signed, false}]).

%% @doc Bytes reserved by the inboxes other than `Index'.
-spec others_share(shares(), pos_integer()) -> non_neg_integer().
others_share(S, Index) -> shares(S) - atomics:get(S, Index).

%% @doc Inbox `Index''s share becomes `Held' (more than `Old', its share now) if
%% the shares stay within `Bound' and the row is not being forgotten: true;
%% otherwise it is `Old' again: false. The share is written before the others
%% and the mark are read: of two inboxes claiming at once the one that reads
%% last sees both claims (both may refuse, never both keep), and a forgetter
%% that marks before it reads (`try_close_shares/1') sees the claim or is seen.
-spec claim_share(shares(), pos_integer(), non_neg_integer(), non_neg_integer(), bound()) ->
          boolean().
claim_share(S, Index, Old, Held, Bound) ->
    atomics:put(S, Index, Held),
    case atomics:get(S, mark(S)) =:= 0 andalso within(shares(S), Bound) of
        true ->
            true;
        false ->
            atomics:put(S, Index, Old),
            false
    end.

%% @doc Inbox `Index''s share becomes `Held' (a release, or 0 at its start).
-spec set_share(shares(), pos_integer(), non_neg_integer()) -> ok.
set_share(S, Index, Held) -> atomics:put(S, Index, Held).

%% @doc Bytes reserved by all inboxes.
-spec shares(shares()) -> non_neg_integer().
shares(S) ->
    lists:sum([atomics:get(S, I) || I <- lists:seq(1, mark(S) - 1)]).

%% @doc The row may be forgotten: true if no inbox reserves anything, and then
%% the mark stays raised, so a claim from then on is refused. Called by one
%% process only (the table's owner), so the mark is a flag.
-spec try_close_shares(shares()) -> boolean().
try_close_shares(S) ->
    Mark = mark(S),
    atomics:put(S, Mark, 1),
    case shares(S) of
        0 ->
            true;
        _ ->
            atomics:put(S, Mark, 0),
            false
    end.

%% The inboxes' slots come first; the mark is the last one.
mark(S) ->
    maps:get(size, atomics:info(S)).

-ifdef(TEST).

%% The most messages and bytes one array can hold, whatever the bounds.
ceiling() -> {?MAX_MSGS, ?MAX_BYTES}.

%% Put a state straight into the word (tests reach the ceiling without 2^26 holds).
set(H, N, B) when N >= 0, N =< ?MAX_MSGS, B >= 0, B =< ?MAX_BYTES ->
    atomics:put(H, ?SLOT, N * ?MSG + B).
-endif.
