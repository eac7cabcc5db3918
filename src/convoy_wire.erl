%% @private
%% The node-to-node protocol. Pure.
%%
%% Every message convoy sends to a peer's convoy is a tuple
%% `{'$convoy', Version, Kind, ...}'; the version travels in every one of them.
%%
%% <ul>
%% <li>`{'$convoy', 1, batch, FromNode, Entries}' goes from an outbound lane (or from
%%   a sender shipping its own message while its lane is idle) to an inbox
%%   (`convoy_inbox_I'). Entries are delivered in list order:
%%   <ul>
%%   <li>`{To, Msg}': send `Msg' to `To' (a local pid, a registered name or an alias);</li>
%%   <li>`{[To], Msg}': multicast, `Msg' to each `To' in order;</li>
%%   <li>`{'$convoy_barrier', ReplyTo, Tag}': answer `{Tag, convoy_barrier}' to
%%     `ReplyTo' once everything before it is delivered.</li>
%%   </ul></li>
%% <li>`{'$convoy', 1, hello | welcome, Info}' goes between `convoy_peers' processes
%%   (the exchange is described in `convoy_peers'). `Info' is a map; unknown keys
%%   are ignored, so a later release can add some before anyone relies on them.
%%   Required: `versions' (protocol versions the sender accepts), `node' (the
%%   sender's node), `peers' (its `convoy_peers' pid, a pid of `node') and `inboxes'
%%   (how many inboxes it runs, 1..`max_inboxes()'). Optional, added in this release:
%%   `request', a reference. In a `hello' it is a fresh alias of the sender's
%%   `convoy_peers' (a reference of `node'): the `welcome' goes to that alias and
%%   carries it back as its own `request'. Only a `welcome' whose `request' is one
%%   the receiver is waiting on, from the node it asked, is learnt from; a `hello'
%%   only prompts the receiver to ask that node itself.</li>
%% </ul>
%% A receiver accepts every version in `versions/0'; a sender uses the highest
%% version both sides accept, learnt from the hello exchange.
-module(convoy_wire).

-export([version/0, versions/0, max_inboxes/0, batch/2, barrier/2, hello/2,
         decode/1, entry/2, negotiate/1, inbox_name/1, inbox_names/1]).

-export_type([entry/0, dest/0, decoded/0, hello_info/0]).

-define(VSN, 1).
-define(MAX_INBOXES, 1024).

-type dest() :: pid() | atom() | reference().
-type entry() :: {dest() | [dest()], term()} | {'$convoy_barrier', pid() | reference(), term()}.
-type hello_info() :: #{versions := [pos_integer()], node := node(), peers := pid(),
                        inboxes := pos_integer(), request => reference()}.
-type decoded() :: {batch, pos_integer(), node(), maybe_improper_list()}
                 | {hello | welcome, hello_info()}
                 | {error, bad_version | malformed_batch | bad_hello | unknown_message}.

-spec version() -> pos_integer().
version() -> ?VSN.

%% @doc Versions this release accepts.
-spec versions() -> [pos_integer()].
versions() -> [?VSN].

-spec max_inboxes() -> pos_integer().
max_inboxes() -> ?MAX_INBOXES.

-spec batch(node(), [entry()]) -> tuple().
batch(FromNode, Entries) -> {'$convoy', ?VSN, batch, FromNode, Entries}.

-spec barrier(pid() | reference(), term()) -> entry().
barrier(ReplyTo, Tag) -> {'$convoy_barrier', ReplyTo, Tag}.

-spec hello(hello | welcome, hello_info()) -> tuple().
hello(Kind, Info) -> {'$convoy', ?VSN, Kind, Info}.

%% @doc Classify anything that arrived at a convoy process from outside.
-spec decode(term()) -> decoded().
decode({'$convoy', Vsn, batch, From, Entries}) when is_integer(Vsn) ->
    case lists:member(Vsn, versions()) of
        false -> {error, bad_version};
        true when is_atom(From), is_list(Entries) -> {batch, Vsn, From, Entries};
        true -> {error, malformed_batch}
    end;
decode({'$convoy', Vsn, Kind, Info}) when Kind =:= hello; Kind =:= welcome ->
    case is_integer(Vsn) andalso valid_hello(Info) andalso valid_request(Kind, Info) of
        true -> {Kind, Info};
        false -> {error, bad_hello}
    end;
decode({'$convoy', _, _, _, _}) ->
    {error, malformed_batch};
decode({'$convoy', _, _, _}) ->
    {error, bad_hello};
decode(_) ->
    {error, unknown_message}.

valid_hello(#{versions := Vs, node := N, peers := P, inboxes := I}) ->
    valid_versions(Vs) andalso is_atom(N) andalso is_pid(P) andalso node(P) =:= N
        andalso is_integer(I) andalso I >= 1 andalso I =< ?MAX_INBOXES;
valid_hello(_) ->
    false.

%% A hello's request is an alias on the sender's node; a welcome's echoes one of
%% the receiver's (checked there against what it is waiting on).
valid_request(hello, #{request := R, node := N}) -> is_reference(R) andalso node(R) =:= N;
valid_request(welcome, #{request := R}) -> is_reference(R);
valid_request(_Kind, _Info) -> true.

valid_versions([V]) -> is_integer(V) andalso V > 0;
valid_versions([V | Rest]) -> is_integer(V) andalso V > 0 andalso valid_versions(Rest);
valid_versions(_) -> false.

%% @doc The highest version both sides accept, or `none'.
-spec negotiate([pos_integer()]) -> pos_integer() | none.
negotiate(Theirs) ->
    case [V || V <- versions(), lists:member(V, Theirs)] of
        [] -> none;
        Common -> lists:max(Common)
    end.

%% @doc Check one batch entry on the receiving node `Local'.
-spec entry(term(), node()) ->
          {deliver, dest(), term()} | {multicast, [dest()], term()}
        | {barrier, pid() | reference(), term()} | {error, bad_entry}.
entry({'$convoy_barrier', ReplyTo, Tag}, _Local) when is_pid(ReplyTo); is_reference(ReplyTo) ->
    {barrier, ReplyTo, Tag};
entry({To, Msg}, Local) when is_list(To) ->
    case all_local(To, Local) of
        true -> {multicast, To, Msg};
        false -> {error, bad_entry}
    end;
entry({To, Msg}, Local) ->
    case local_dest(To, Local) of
        true -> {deliver, To, Msg};
        false -> {error, bad_entry}
    end;
entry(_, _) ->
    {error, bad_entry}.

%% Also false for an improper list.
all_local([], _Local) -> true;
all_local([D | Rest], Local) -> local_dest(D, Local) andalso all_local(Rest, Local);
all_local(_, _Local) -> false.

local_dest(D, Local) when is_pid(D); is_reference(D) -> node(D) =:= Local;
local_dest(D, _Local) -> is_atom(D) andalso D =/= undefined.

-spec inbox_name(pos_integer()) -> atom().
inbox_name(I) -> list_to_atom("convoy_inbox_" ++ integer_to_list(I)).

%% @doc Names of a peer's inboxes, 1..N; N is bounded by `max_inboxes/0' so a peer
%% cannot make this node create atoms without limit.
-spec inbox_names(pos_integer()) -> tuple().
inbox_names(N) when N >= 1, N =< ?MAX_INBOXES ->
    list_to_tuple([inbox_name(I) || I <- lists:seq(1, N)]).

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

decode_batch_test() ->
    B = batch(a@h, [{self(), hi}]),
    ?assertMatch({batch, 1, a@h, [_]}, decode(B)).

decode_rejects_test() ->
    ?assertEqual({error, bad_version}, decode({'$convoy', 99, batch, a@h, []})),
    ?assertEqual({error, malformed_batch}, decode({'$convoy', 1, batch, a@h, notalist})),
    ?assertEqual({error, malformed_batch}, decode({'$convoy', 1, batch, "a", []})),
    ?assertEqual({error, malformed_batch}, decode({'$convoy', x, y, z, w})),
    ?assertEqual({error, bad_hello}, decode({'$convoy', 1, hello, #{}})),
    ?assertEqual({error, unknown_message}, decode(hello)).

hello_roundtrip_test() ->
    Info = #{versions => [1], node => node(), peers => self(), inboxes => 2, extra => x},
    ?assertEqual({hello, Info}, decode(hello(hello, Info))),
    ?assertEqual({error, bad_hello}, decode(hello(hello, Info#{inboxes := 5000}))).

hello_request_test() ->
    Info = #{versions => [1], node => node(), peers => self(), inboxes => 2},
    Ref = make_ref(),
    ?assertEqual({hello, Info#{request => Ref}}, decode(hello(hello, Info#{request => Ref}))),
    ?assertEqual({welcome, Info#{request => Ref}}, decode(hello(welcome, Info#{request => Ref}))),
    ?assertEqual({error, bad_hello}, decode(hello(hello, Info#{request => x}))),
    ?assertEqual({error, bad_hello}, decode(hello(welcome, Info#{request => self()}))),
    %% A hello's request must be a reference of the node the hello claims.
    ?assertEqual({error, bad_hello}, decode(hello(hello, Info#{request => ref_of(other@host)}))),
    ?assertMatch({welcome, _}, decode(hello(welcome, Info#{request => ref_of(other@host)}))).

%% A reference of another node, as if it had arrived from there.
ref_of(Node) ->
    N = atom_to_binary(Node, utf8),
    binary_to_term(<<131, 90, 3:16, 119, (byte_size(N)), N/binary, 1:32, 11:32, 22:32, 33:32>>).

entry_test() ->
    L = node(),
    ?assertEqual({deliver, self(), m}, entry({self(), m}, L)),
    ?assertEqual({deliver, foo, m}, entry({foo, m}, L)),
    ?assertEqual({error, bad_entry}, entry({undefined, m}, L)),
    ?assertEqual({error, bad_entry}, entry({1, m}, L)),
    ?assertEqual({multicast, [self(), foo], m}, entry({[self(), foo], m}, L)),
    ?assertEqual({error, bad_entry}, entry({[self(), 1], m}, L)),
    ?assertEqual({error, bad_entry}, entry({[self() | foo], m}, L)),
    ?assertEqual({error, bad_entry}, entry({self(), m}, other@host)),
    ?assertMatch({barrier, _, t}, entry(barrier(self(), t), L)),
    ?assertEqual({error, bad_entry}, entry({a, b, c}, L)).

negotiate_test() ->
    ?assertEqual(1, negotiate([1, 2])),
    ?assertEqual(none, negotiate([7])).
-endif.
